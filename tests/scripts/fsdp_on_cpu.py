"""Run a script with accelerate's FSDP kept in CPU processes (testing.allow_fsdp_on_cpu), for the FSDP tests:

    accelerate launch --config_file configs/accelerate/fsdp2.yaml --num_processes 2 --mixed_precision no \
        tests/scripts/fsdp_on_cpu.py SCRIPT [ARGS ...]

The script then runs as ``__main__`` with ``ARGS``, as if launched itself; its trainers build their Accelerator with
the FSDP state, their parameters become FSDP2 shards (DTensors) over a CPU mesh, and gloo carries the collectives.
"""

from __future__ import annotations

import os
import runpy
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), os.path.dirname(HERE)]  # the repository root, tests/

from testing import allow_fsdp_on_cpu  # noqa: E402

if __name__ == "__main__":
    allow_fsdp_on_cpu()
    script = os.path.abspath(sys.argv[1])
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(script))  # as when the script is run itself
    runpy.run_path(script, run_name="__main__")
