"""benchmarks/common.py's RSS of a job: the launching process and the worker processes it started."""

import subprocess
import sys

from benchmarks.common import RssSampler


def first_sample(pid: int) -> float:
    sampler = RssSampler(pid, interval=0.05)
    sampler.start()
    while not sampler.samples:
        sampler.done.wait(0.01)
    sampler.done.set()
    sampler.join()
    return sampler.samples[0][1]


def test_the_rss_of_a_job_counts_its_worker_processes(tmp_path):
    """The sampler read the launching process alone: a multi_processing run's workers (2 x 850 MiB
    beside a 484 MiB launcher) were left out of soak_extract's and bench_memory's RSS over time."""
    holder = tmp_path / "holder.py"
    holder.write_text(
        "import subprocess, sys\n"
        "held = b'x' * (int(sys.argv[1]) << 20)\n"
        "kids = [subprocess.Popen([sys.executable, __file__, sys.argv[1]], stdin=subprocess.PIPE, stdout=subprocess.PIPE)\n"
        "        for _ in range(int(sys.argv[2]) if len(sys.argv) > 2 else 0)]\n"
        "for kid in kids:\n"
        "    kid.stdout.readline()\n"
        "print('ready', flush=True)\n"
        "sys.stdin.read()\n"
        "for kid in kids:\n"
        "    kid.stdin.close()\n"
        "    kid.wait()\n")
    alone = subprocess.Popen([sys.executable, str(holder), "40"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    job = subprocess.Popen([sys.executable, str(holder), "40", "2"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert alone.stdout.readline() == job.stdout.readline() == b"ready\n"
        one, three = first_sample(alone.pid), first_sample(job.pid)
        assert 40 < one < 80  # 40 MiB held, and the interpreter
        assert 3 * 40 < three and abs(three - 3 * one) < 30  # the job and its two workers, each as one
    finally:
        for process in (alone, job):
            process.stdin.close()
            process.wait()
