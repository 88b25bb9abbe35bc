"""07 and 08's steps beside the anchors at the headline shapes (N = 4096, D 128 and 64, both masks), one run."""
import os, shlex, sys
sys.path.insert(0, os.path.join(os.getcwd(), "common"))
import stages
from results import bench_shape, write_results
from report import print_summary
dims = [int(x) for x in sys.argv[1:]] or [128, 64]
shapes = [bench_shape(d, 4096, c) for d in dims for c in (0, 1)]
rows = stages.bench_chapters("build", ["07_async_pipeline", "08_fp8"], shapes)
rows += stages.measure_anchors(shapes)
out = os.environ["OUT"]
write_results(os.path.join(out, "headline.csv"), rows)
stages.write_env(os.path.join(out, "headline.env"), stages.collect_env(shlex.join([sys.executable] + sys.argv)))
print_summary(rows)
