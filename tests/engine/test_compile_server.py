"""The grammar compile worker process exits quietly when its parent goes away at any point."""

from __future__ import annotations

import os
import subprocess
import sys


def _run_with_closed_pipes(setup: bytes | None) -> subprocess.CompletedProcess:
    to_child_r, to_child_w = os.pipe()
    from_child_r, from_child_w = os.pipe()
    cmd = [sys.executable, "-m", "engine.structured.compile_server", str(to_child_r), str(from_child_w), "0"]
    proc = subprocess.Popen(cmd, pass_fds=(to_child_r, from_child_w), stderr=subprocess.PIPE)
    os.close(to_child_r)
    os.close(from_child_w)
    os.close(from_child_r)  # nobody will read the child's answer: its b"ready" meets a broken pipe
    if setup is not None:
        from multiprocessing.connection import Connection

        Connection(to_child_w, readable=False).send_bytes(setup)  # closes to_child_w when collected
    else:
        os.close(to_child_w)
    _, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(cmd, proc.returncode, None, err.decode())


def test_parent_gone_before_setup_exits_zero_without_a_traceback():
    done = _run_with_closed_pipes(None)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr


def test_parent_gone_before_ready_exits_zero_without_a_traceback():
    import xgrammar as xgr
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "b": 1, "<unk>": 2}, "<unk>")))
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=3)
    import json

    done = _run_with_closed_pipes(json.dumps({"tokenizer_info": info.serialize_json(), "max_bytes": 1 << 20}).encode())
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
