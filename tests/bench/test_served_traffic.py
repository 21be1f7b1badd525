"""``bench.served_traffic``: its counters from a ``/metrics`` text, where a request's chunks came
from, its requests' spans, the report (from synthetic rows) and ``--dry-run``; the live run is the
benchmark itself (docs/perf/cpu-served-traffic)."""
import http.server
import json
import threading

import pytest

from bench import served_traffic as st
from bench import traffic
from bench.traffic_report import write_served_report

METRICS = """# HELP vllm:ragattn_chunks_hit_total chunk spans reused
vllm:ragattn_chunks_hit_total{engine="0",model_name="m"} 17.0
vllm:ragattn_chunks_missed_total{engine="0",model_name="m"} 3.0
vllm:ragattn_store_disk_loads_total{engine="0",model_name="m"} 5.0
vllm:ragattn_store_remote_hits_total{engine="0",model_name="m"} 0.0
vllm:ragattn_load_seconds_total{engine="0",model_name="m"} 1.25
vllm:ragattn_chunks_hit_created{engine="0",model_name="m"} 1.7e9
vllm:num_requests_running{engine="0",model_name="m"} 0.0
"""


@pytest.fixture
def metrics_server():
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(METRICS.encode())

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_read_counters_and_sources(metrics_server):
    c = st.read_counters(metrics_server)
    assert c == dict(chunks_hit=17.0, chunks_missed=3.0, store_disk_loads=5.0, store_remote_hits=0.0,
                     load_seconds=1.25)
    before = dict(c, chunks_hit=12.0, chunks_missed=2.0, store_disk_loads=3.0)
    assert st.sources(before, c) == dict(memory=3, disk=2, remote=0, recompute=1)


def test_requests_spans_cover_the_head_and_every_passage(smollm2):
    _, tok = smollm2
    texts = [f"Passage {i} tells of the river town number {i} and its {i * 7} bridges." for i in range(9)]
    prompts = st.build_requests(tok, [[3, 1, 7], [0, 8, 2]], [1, 0], texts, ["Which town?", "How many bridges?"])
    for p in prompts:
        assert [s[0] for s in p.spans[1:]] == [s[1] for s in p.spans[:-1]] and p.spans[0][0] == 0
        assert [p.tokens[a:b] for a, b in p.spans] == p.chunks and len(p.tokens) > p.spans[-1][1]
        body = st.request_body("m", p, p.spans)
        assert body["max_tokens"] == 1 and body["kv_transfer_params"]["ragattn_spans"] == p.spans
        assert "kv_transfer_params" not in st.request_body("m", p)


def test_report_from_rows(tmp_path):
    rows = [dict(tier="disk", i=i, t_s=i * 0.4, ttft_s=0.2 + 0.01 * i, prompt_len=300, from_memory=3, from_disk=2,
                 from_remote=0, from_recompute=0, resident_bytes=0, rss_bytes=2**31) for i in range(16)]
    for i in (4, 12):
        rows[i].update(full_s=0.9, warm_s=0.19, agrees=True, warm_same=i == 12)
    summ = traffic.summary(rows)
    result = dict(meta=dict(command="c", commit="abc", date="d", threads=1, start_s={"disk": 200.0},
                            load_before=[1, 1, 1], load_after=[2, 2, 2], model="m", corpus_passages=10,
                            corpus_tokens=900, corpus_kv_bytes=2**25, memory_budget=2**23, build_s=3.0),
                  args=dict(requests=16, passages=4, zipf=1.1, probe_every=8),
                  tiers={"disk": dict(rows=rows, windows=traffic.windows(rows, 8, summ["full_p50_ms"] / 1e3),
                                      **summ)}, target_fraction=traffic.TARGET_FRACTION)
    write_served_report(str(tmp_path), result)
    md = (tmp_path / "served_traffic.md").read_text()
    assert "| disk | 1 |" in md and "4.0x smaller" in md
    assert json.loads((tmp_path / "served_traffic.json").read_text())["tiers"]["disk"]["probes"] == 1


def test_dry_run_prints_requests_and_commands(capsys, smollm2):
    assert st.main(["--dry-run", "--requests", "20", "--tiers", "disk,remote"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert sum(line.startswith("{") for line in out) == 3
    cmds = [line for line in out if line.split(":")[0] in ("warm", "disk", "remote")]
    assert len(cmds) == 3 and all("--no-enable-prefix-caching" in c and "memory_budget" in c for c in cmds)


@pytest.mark.parametrize("argv, needle", [(["--tiers", "ssd"], "--tiers"), (["--budget-fraction", "0"], "budget"),
                                          (["--requests", "6"], "--requests")])
def test_bad_arguments(capsys, argv, needle):
    with pytest.raises(SystemExit):
        st._parse(["--dry-run", *argv])
    assert needle in capsys.readouterr().err
