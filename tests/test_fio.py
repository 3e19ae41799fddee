"""kvtier bench: fio options, job files, fio's JSON field names, baselines."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvtier.errors import ConfigError
import numpy as np

from kvtier.fio import Job, _order, apply_option, main, parse_jobfile, run_job


def test_options_in_fio_units():
    j = Job()
    for k, v in (("rw", "randrw"), ("bs", "64k"), ("size", "1g"), ("iodepth", "32"),
                 ("numjobs", "2"), ("runtime", "10s"), ("ramp_time", "500ms"), ("direct", "1"),
                 ("random_distribution", "zipf:1.2"), ("tier", "nvme")):
        j = apply_option(j, k, v)
    assert (j.rw, j.bs, j.size, j.iodepth, j.numjobs) == ("randrw", 65536, 1 << 30, 32, 2)
    assert (j.runtime, j.ramp_time, j.direct, j.zipf, j.tier) == (10.0, 0.5, True, 1.2, "nvme")
    j.validate()


@pytest.mark.parametrize("key,value,match", [
    ("rw", "sideways", "rw="), ("bs", "huge", "bs"), ("iodepth", "x", "iodepth"),
    ("random_distribution", "pareto:1", "zipf"), ("runtime", "soon", "runtime"),
    ("tier", "tape", "tier="), ("frobnicate", "1", "unknown fio option"),
])
def test_bad_options_are_errors(key, value, match):
    with pytest.raises(ConfigError, match=match):
        apply_option(Job(), key, value).validate()


def test_job_file_global_and_sections():
    jobs = parse_jobfile("""
; a comment
[global]
bs=4k
size=8m
runtime=1
tier=host
ioengine=libaio

[reader]
rw=randread
iodepth=8

[writer]
rw=write
bs=16k
direct
""")
    assert [j.name for j in jobs] == ["reader", "writer"]
    assert (jobs[0].bs, jobs[0].iodepth, jobs[0].rw) == (4096, 8, "randread")
    assert (jobs[1].bs, jobs[1].direct, jobs[1].size) == (16384, True, 8 << 20)


@pytest.mark.parametrize("text,match", [
    ("[global]\nbs=4k\n", "no job section"),
    ("bs=4k\n", "job file"),
    ("[j]\nrw=sometimes\n", "rw="),
])
def test_garbage_job_files(text, match):
    with pytest.raises(ConfigError, match=match):
        parse_jobfile(text)


def test_json_uses_fio_field_names(tmp_path: Path, capsys):
    jf = tmp_path / "j.fio"
    jf.write_text("[global]\nbs=4k\nsize=1m\nruntime=0.3\niodepth=4\n[r]\nrw=randread\n"
                  "[w]\nrw=write\ntier=nvme\n")
    assert main([str(jf), "--output-format=json", "--directory", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out)
    r, w = out["jobs"]
    assert r["jobname"] == "r" and r["error"] == 0
    for side in ("read", "write"):
        assert {"iops", "bw_bytes", "bw", "io_bytes", "runtime", "total_ios", "clat_ns"} <= set(r[side])
    assert r["read"]["total_ios"] > 0 and r["write"]["total_ios"] == 0
    assert {"min", "max", "mean", "stddev", "percentile"} <= set(r["read"]["clat_ns"])
    assert "99.000000" in r["read"]["clat_ns"]["percentile"]
    assert w["write"]["total_ios"] > 0 and w["kvtier"]["nvme_write_amplification"] >= 1.0
    assert r["kvtier"]["hit_ratio"] == 1.0


def test_text_report_and_memcpy_baseline(tmp_path: Path, capsys):
    plot = tmp_path / "p.png"
    assert main(["--rw=read", "--bs=4k", "--size=1m", "--runtime=0.3", "--compare",
                 "--plot", str(plot)]) == 0
    text = capsys.readouterr().out
    assert "IOPS=" in text and "clat percentiles" in text and "x memcpy" in text
    assert plot.stat().st_size > 1000


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is installed by make test (tools/system-deps)")
def test_fio_baseline_in_the_same_run(tmp_path: Path, capsys):
    assert main(["--rw=randread", "--bs=4k", "--size=4m", "--runtime=0.5", "--tier=nvme",
                 "--direct=1", "--compare", "--output-format=json",
                 "--directory", str(tmp_path)]) == 0
    job = json.loads(capsys.readouterr().out)["jobs"][0]
    assert job["kvtier"]["baseline"]["name"] == "fio"
    assert job["kvtier"]["baseline"]["result"]["read"]["bw_bytes"] > 0
    assert job["kvtier"]["ratio_read"] > 0


def test_zipf_and_mixed_run_through_the_engine(tmp_path: Path):
    job = Job(rw="randrw", bs=4096, size=1 << 20, runtime=0.3, iodepth=4, zipf=1.1,
              directory=str(tmp_path), numjobs=2)
    res = run_job(job)
    assert res["read"]["total_ios"] > 0 and res["write"]["total_ios"] > 0 and res["error"] == 0


def test_every_nvme_read_of_a_mixed_zipf_job_comes_from_the_disk(tmp_path: Path):
    # As fio's direct=1 reads do: with the batch just read or written left resident, 22-32%
    # of a zipf job's reads were host hits (fio10).
    job = Job(rw="randrw", bs=4096, size=1 << 20, runtime=0.5, iodepth=8, zipf=1.2,
              directory=str(tmp_path), tier="nvme")
    res = run_job(job)
    tiers = res["kvtier"]["tiers"]
    assert res["read"]["total_ios"] > 100 and tiers["nvme"]["hits"] > 100
    assert tiers["host"]["hits"] == 0


def test_zipf_picks_follow_fio_s_bounded_zipf_scattered_over_the_file():
    job = Job(rw="randrw", zipf=1.1)
    picks = _order(job, 4096, np.random.default_rng(3), 400_000)
    assert picks.min() >= 0 and picks.max() < 4096
    counts = np.sort(np.bincount(picks, minlength=4096))[::-1]
    w = np.arange(1, 4097, dtype=np.float64) ** -1.1
    assert abs(counts[0] / picks.size - w[0] / w.sum()) < 0.005    # 0.160, as fio's zipf
    assert 1.9 < counts[0] / counts[1] < 2.4                        # 2^1.1 = 2.14
    hottest = np.argsort(np.bincount(picks, minlength=4096))[::-1][:8]
    assert sorted(hottest.tolist()) != list(range(8))              # not the file's first blocks


def test_zipf_over_a_large_file_keeps_its_shape_in_bounded_memory():
    n = 1 << 28                                  # 1 TiB of 4 KiB blocks: no 2 GiB weight array
    picks = _order(Job(rw="randread", zipf=1.1), n, np.random.default_rng(5), 200_000)
    assert picks.min() >= 0 and picks.max() < n
    values, counts = np.unique(picks, return_counts=True)
    w = np.arange(1, 1 << 20, dtype=np.float64) ** -1.1
    share = w[0] / (w.sum() + ((n + 0.5) ** -0.1 - (1 << 20) ** -0.1) / -0.1)
    assert abs(counts.max() / picks.size - share) < 0.005
    assert values.size > 50_000                  # the tail is drawn, not clipped to the head


def test_rwmixread_sets_the_mix(tmp_path: Path):
    j = apply_option(apply_option(Job(), "rw", "randrw"), "rwmixread", "70")
    assert j.rwmixread == 70
    assert apply_option(Job(), "rwmixwrite", "30").rwmixread == 70
    r = run_job(Job(rw="randrw", rwmixread=80, bs=4096, size=1 << 20, iodepth=4, runtime=0.5,
                    tier="host", directory=str(tmp_path)))
    reads, writes = r["read"]["total_ios"], r["write"]["total_ios"]
    assert reads > 2 * writes > 0                     # 80/20, not fio-less 50/50


@pytest.mark.parametrize("args,match", [
    (["--directory", "/nonexistent/kvtier"], "does not exist"),
    (["--rw", "randrw", "--rwmixread", "170"], "rwmixread"),
    (["--rwmixread", "lots"], "rwmixread"),
    (["/nonexistent/jobs.fio"], "cannot read job file"),
    (["--bs", "0"], "bs="),
])
def test_bad_options_and_paths_are_one_line_errors(args, match):
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "kvtier.cli", "bench", *args, "--runtime", "1"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and match in lines[0] and "Traceback" not in out.stderr


def test_iodepth_is_split_over_the_calls_in_flight():
    assert Job(iodepth=16, tier="nvme").call_sizes() == [16]          # auto: one call
    assert Job(iodepth=16, tier="nvme", calls=2).call_sizes() == [8, 8]
    assert Job(iodepth=16, tier="host").call_sizes() == [16]
    assert Job(iodepth=5, calls=2).call_sizes() == [3, 2]
    assert Job(iodepth=1, tier="nvme").call_sizes() == [1]
    assert apply_option(Job(), "calls", "4").calls == 4
    with pytest.raises(ConfigError, match="calls=5"):
        Job(iodepth=4, calls=5).validate()
    with pytest.raises(ConfigError, match="in-process tier"):
        Job(iodepth=4, calls=2, tier="service").validate()


def test_a_jobs_calls_in_flight_never_hold_more_than_iodepth_blocks(tmp_path: Path, monkeypatch):
    # fio keeps iodepth I/Os in flight, never more: the calls a job has in flight together
    # hold at most iodepth blocks, each put acknowledged (synced) before its lane's next call.
    import threading
    import time

    import kvtier.fio as fio
    lock, now, top, calls = threading.Lock(), [0], [0], []

    def counted(real):
        def call(self, idx, *args, **kw):
            if idx.size == 8:                   # the untimed fill, one call of iodepth
                return real(self, idx, *args, **kw)
            with lock:
                now[0] += idx.size
                top[0] = max(top[0], now[0])
            try:
                time.sleep(0.002)               # long enough for the calls to overlap
                return real(self, idx, *args, **kw)
            finally:
                with lock:
                    now[0] -= idx.size
                    calls.append(idx.size)
        return call

    monkeypatch.setattr(fio._Target, "put", counted(fio._Target.put))
    monkeypatch.setattr(fio._Target, "get", counted(fio._Target.get))
    res = run_job(Job(rw="randrw", bs=4096, size=1 << 20, iodepth=8, calls=2, runtime=0.5,
                      tier="nvme", directory=str(tmp_path)))
    assert res["error"] == 0 and res["read"]["total_ios"] > 0 and res["write"]["total_ios"] > 0
    assert res["kvtier"]["calls_in_flight"] == 2 and set(calls) == {4} and len(calls) > 20
    assert top[0] == 8                          # both lanes' calls overlapped, never more


def test_an_nvme_get_copies_out_the_blocks_it_asked_for(tmp_path: Path):
    # The bench's copy out of the pool (a checked take, fio6) lands each block asked for, in
    # order, repeats and all: block b was filled with data[b % iodepth].
    from kvtier.fio import _Target
    job = Job(rw="randread", bs=4096, iodepth=4, size=64 * 4096, tier="nvme",
              directory=str(tmp_path)).validate()
    target = _Target(job, str(tmp_path))
    try:
        target.fill()
        out = np.zeros((4, 4096), dtype=np.uint8)
        for idx in ([5, 0, 63, 17], [9, 9, 2, 40], [1]):
            idx = np.array(idx)
            out[:] = 0
            assert target.get(idx, owner=1, out=out)
            assert np.array_equal(out[: idx.size], target.data[idx % job.iodepth])
    finally:
        target.close()


def test_the_bench_s_buffers_start_on_a_page_boundary(tmp_path: Path):
    # A get's copy out of the pool (page-aligned slots) into a buffer 16 bytes into a page ran
    # the string copy's slow path, 10x the CPU (fio6): the lane's buffers and the put's source
    # rows are page-aligned, as fio's are.
    import mmap
    from kvtier.fio import _Target, page_aligned
    a = page_aligned(3, 4096 + 512)
    assert a.shape == (3, 4608) and a.ctypes.data % mmap.PAGESIZE == 0 and a.flags.writeable
    job = Job(rw="randread", bs=4096, iodepth=4, size=16 * 4096, tier="nvme",
              directory=str(tmp_path)).validate()
    target = _Target(job, str(tmp_path))
    try:
        assert target.data.ctypes.data % mmap.PAGESIZE == 0 and target.data.shape == (4, 4096)
    finally:
        target.close()
