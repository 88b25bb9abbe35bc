#!/usr/bin/env python3
"""Graded exercises cut from the chapters' own code: make exercise, make grade, make handout.

  exercises.py list                                             every exercise: name, kind, grading, task
  exercises.py make CHAPTER [--only NAME,...] [--force]         (make exercise CH=04 [EX=..] [FORCE=1])
  exercises.py grade CHAPTER --build DIR [--make CMD]           (make grade CH=04)
  exercises.py handout CHAPTER --out DIR                        (make handout CH=04)

What each part does lives in a module of its own: exercise_markers.py (the markers in a chapter's
source and each exercise's facts: the format), exercise_copy.py (the student copy), exercise_grade.py
(the grader) and exercise_handout.py (a hand-out for a class).
"""
import argparse
import os
import sys

from exercise_copy import command_list, command_make
from exercise_grade import command_grade
from exercise_handout import command_handout


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="every exercise")
    made = sub.add_parser("make", help="write the student copy of a chapter")
    made.add_argument("chapter")
    made.add_argument("--only", help="exercise names, comma-separated (default: all of the chapter's)")
    made.add_argument("--force", action="store_true", help="overwrite a copy you have edited")
    graded = sub.add_parser("grade", help="build and grade the student copy of a chapter")
    graded.add_argument("chapter")
    graded.add_argument("--build", default="build", help="make's BUILD folder")
    graded.add_argument("--make", default="make", help="the make command")
    handed = sub.add_parser("handout", help="a hand-out of a chapter's exercises, without their solution")
    handed.add_argument("chapter")
    handed.add_argument("--out", default=os.path.join("build", "handout"), help="the folder of the .tar.gz")
    args = parser.parse_args(argv)
    return {"list": command_list, "make": command_make, "grade": command_grade,
            "handout": command_handout}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
