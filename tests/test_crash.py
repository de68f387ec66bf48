"""A run killed with SIGKILL resumes from its last complete checkpoint and finishes; nothing before it is lost."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from armor_trl.integration.checkpoint import STATE_FILE
from testing import SCRIPTS

SCRIPT = SCRIPTS / "crash_train_script.py"


def complete_checkpoints(output_dir: Path) -> list[int]:
    return sorted(
        int(p.name.split("-")[1]) for p in output_dir.glob("checkpoint-*") if (p / STATE_FILE).exists()
    )


def test_sigkill_then_resume_finishes(tiny_model_path, tmp_path):
    output_dir = tmp_path / "run"
    command = [sys.executable, str(SCRIPT), "--model", tiny_model_path, "--output_dir", str(output_dir)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    victim = subprocess.Popen(command + ["--max_steps", "50", "--sleep", "0.5"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while time.time() < deadline and len(complete_checkpoints(output_dir)) < 2 and victim.poll() is None:
        time.sleep(0.2)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    before_kill = complete_checkpoints(output_dir)
    assert len(before_kill) >= 2, "the run never wrote two checkpoints"
    last = max(before_kill)
    files_before = {p: p.read_bytes() for p in (output_dir / f"checkpoint-{last}").iterdir() if p.is_file()}

    resumed = subprocess.run(command + ["--max_steps", str(last + 2), "--resume"], env=env,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"FINISHED step={last + 2}" in resumed.stdout
    after = complete_checkpoints(output_dir)
    assert set(before_kill) <= set(after)  # nothing before the kill is lost
    for path, content in files_before.items():  # the last complete checkpoint is intact
        assert path.read_bytes() == content, path
