"""Will a new version fit: the estimate (weights as loaded + KV budget), the room (CPU from /proc, CUDA
from the running engine's report, cached-but-free memory counted), and the refusal's message."""

from __future__ import annotations

import json
import platform

import pytest

from server.ops import memory_check
from server.ops.memory import DeviceMemory, memory_probe
from server.ops.memory_check import MemoryNeed, MemoryRoom

GIB = 1 << 30


def test_estimate_counts_weights_as_loaded(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1000)
    (tmp_path / "tokenizer.json").write_bytes(b"\0" * 5000)  # not weights
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "other.safetensors").write_bytes(b"\0" * 7000)  # another folder's
    assert memory_check.weights_on_disk(tmp_path) == 1000
    assert memory_check.estimate(tmp_path, "float32", 64) == MemoryNeed(2000, 64)  # bf16 read as float32
    assert memory_check.estimate(tmp_path, "bfloat16", 64) == MemoryNeed(1000, 64)
    assert memory_check.estimate(tmp_path, "auto", 0).total == 1000
    assert memory_check.weights_on_disk(tmp_path / "model.safetensors") == 1000  # a single-file model
    assert memory_check.weights_on_disk(tmp_path / "missing") == 0


def test_check_refuses_naming_the_numbers():
    room = MemoryRoom("cpu", available=10 * GIB, total=16 * GIB)
    memory_check.check("m@v2", MemoryNeed(4 * GIB, 4 * GIB), room, headroom=0.1)  # 8 + 1.6 <= 10
    with pytest.raises(memory_check.InsufficientMemory) as e:
        memory_check.check("m@v2", MemoryNeed(4 * GIB, 5 * GIB), room, headroom=0.1)
    message = str(e.value)
    assert "m@v2 needs about 9.00 GiB (weights 4.00 GiB + KV cache 5.00 GiB)" in message
    assert "10.00 GiB free of 16.00 GiB, 10% of it kept free" in message and "kv_cache_memory" in message


def test_room_on_cuda_counts_the_allocators_free_blocks_and_the_cap():
    report = {"used_bytes": 60 * GIB, "total_bytes": 100 * GIB, "allocated_bytes": 40 * GIB,
              "reserved_bytes": 50 * GIB, "kv_cache_bytes": 1}  # fmt: skip

    class Gpu:
        device_name = "cuda:0"

        def device_memory(self):
            return report

    memory = memory_probe(Gpu())()
    assert memory == DeviceMemory("cuda:0", 60 * GIB, 100 * GIB, 10 * GIB)
    room = memory_check.room(memory, gpu_memory_utilization=0.9)
    assert room == MemoryRoom("cuda:0", (90 - 60 + 10) * GIB, 100 * GIB)
    host = memory_check.room(DeviceMemory("cpu", 1, 2), 0.9)  # the CPU: the host's own figures
    assert host.device == "cpu" and 0 < host.available <= host.total
    if platform.libc_ver()[0] == "glibc":
        assert memory_check.return_freed_memory() is True  # malloc_trim found and called
