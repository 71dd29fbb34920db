"""bench/peers/*.sh pass shellcheck, and compare.sh finds its peers where PEERS and LLAMA_SERVER say,
resolves its paths from the caller's folder, and leaves one `vllm bench serve` result per system and
concurrency in OUT: run here against stand-ins (a llama-server and a `vllm` client that only answer),
so no peer is installed and nothing is timed."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from bench.report.compare import read_compare_dir
from tests.ci_skips import skip_or_fail
from tests.test_layering import ROOT

SCRIPTS = sorted((ROOT / "bench" / "peers").glob("*.sh"))

FAKE_LLAMA = """\
#!{python}
# answers /health and /v1/models on --port; writes its arguments where the test can read them
import http.server, json, sys
open({args!r}, "w").write(json.dumps(sys.argv[1:]))
port = int(sys.argv[sys.argv.index("--port") + 1])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({{"data": [{{"id": "fake-model"}}]}}).encode()
        self.send_response(200); self.send_header("content-length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""

FAKE_VLLM = """\
#!{python}
# `vllm bench serve ... --result-dir D --result-filename F`: a result as vllm writes one, no requests sent
import json, sys
a = sys.argv
get = lambda flag: a[a.index(flag) + 1]
c, n = int(get("--max-concurrency")), int(get("--num-prompts"))
json.dump({{"date": "20261207-093000", "output_throughput": 10.0 * c, "median_ttft_ms": 100.0, "p99_ttft_ms": 200.0,
           "median_tpot_ms": 20.0, "p99_tpot_ms": 30.0, "completed": n, "num_prompts": n, "model_id": get("--model")}},
          open(get("--result-dir") + "/" + get("--result-filename"), "w"))
"""


def _executable(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)


def test_peer_scripts_pass_shellcheck():
    shellcheck = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    if not shellcheck:
        skip_or_fail("shellcheck is not installed (run `make tools`)")
    assert [p.name for p in SCRIPTS] == ["compare.sh", "lora_peers.sh", "spec_peers.sh"]
    done = subprocess.run([shellcheck, *map(str, SCRIPTS)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


def test_compare_sh_uses_peers_and_llama_server_and_leaves_results(tmp_path):
    with socket.socket() as s:  # a free port for the stand-in llama-server (LLAMA_PORT), not the default 8200
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    python = sys.executable
    peers, vllm_dir, work = tmp_path / "peers", tmp_path / "vllm", tmp_path / "caller"
    _executable(peers / "vllm" / "setup.sh", "echo peers setup ran from \"$0\"\n")
    (vllm_dir / "env.sh").parent.mkdir(parents=True)
    (vllm_dir / "env.sh").write_text("")
    _executable(vllm_dir / "bin" / "vllm", FAKE_VLLM.format(python=python))
    _executable(tmp_path / "llama" / "llama-server", FAKE_LLAMA.format(python=python, args=str(tmp_path / "args.json")))
    (work / "model").mkdir(parents=True)
    (work / "m.gguf").write_text("")
    env = {**os.environ, "PEERS": str(peers), "VLLM_DIR": str(vllm_dir), "OUT": "out", "SKIP_TM": "1",
           "SKIP_VLLM": "1", "LLAMA_SERVER": str(tmp_path / "llama" / "llama-server"), "LLAMA_PORT": str(port)}
    done = subprocess.run([str(ROOT / "bench" / "peers" / "compare.sh"), "model", "m.gguf", "1 16"], cwd=work, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    out = work / "out"  # OUT as the caller wrote it, relative to the caller's folder
    assert f"peers setup ran from {peers}/vllm/setup.sh" in (out / "vllm-setup.log").read_text()
    args = json.loads((tmp_path / "args.json").read_text())
    assert args[:2] == ["-m", str(work / "m.gguf")] and args[args.index("--port") + 1] == str(port)
    assert sorted(p.name for p in out.glob("*.json")) == ["llama.cpp-c1.json", "llama.cpp-c16.json"]
    assert "llama.cpp  c16  out   160.0 tok/s" in done.stdout
    (out / "tokenmill-c1.json").write_text((out / "llama.cpp-c1.json").read_text())  # what SKIP_TM left out
    rec = read_compare_dir(out, "zen3", "822679b", "compare.sh model m.gguf")
    assert [r["system"] for r in rec.rows] == ["tokenmill", "llama.cpp server"]
    assert rec.rows[1]["points"]["16"]["done"] == "64/64"
