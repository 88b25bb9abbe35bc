// forward.cu: forward.h's forward pass as an object of its own (BUILD/common/forward.o), compiled once
// and linked into every build of 09, 10 and 11 (the Makefile); see forward.h.
#define HARNESS_SOURCE  // harness.h: the exercise stub's variable and reader belong to the chapter
#include "../common/harness.h"
#include "forward.h"
