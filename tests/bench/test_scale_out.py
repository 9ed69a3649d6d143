"""bench.scale_out: one setup's measurement against a live server (the Ray setups run the
same measurement behind the ingress; tests/scale_out covers the ingress itself)."""

from __future__ import annotations

from bench.scale_out import format_report, measure, parse_args


def test_a_setup_reports_latencies_and_the_cache_hits_of_each_server(tiny_server: str) -> None:
    system = "You answer in one short word, whatever the question is. " * 3
    workload = [
        (
            tenant,
            {
                "model": "tiny",
                "messages": [
                    {"role": "system", "content": f"Tenant {tenant}. {system}"},
                    {"role": "user", "content": f"Question {question}?"},
                ],
                "max_tokens": 4,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
        for tenant in range(2)
        for question in range(2)
    ]
    args = parse_args(["--rate", "2", "--tenants", "2", "--questions", "2"])
    report = measure("single", tiny_server, workload, args)
    assert (report.finished, report.unfinished, report.errors) == (4, 0, [])
    assert report.ttft_p50_ms is not None and report.output_tokens_per_s > 0
    [server] = report.replicas
    assert server.replica == "server" and server.requests == 4
    assert server.hit > 0, "a tenant's second question reuses its system prompt"
    assert "1 server, 2 threads" in format_report([report], args)
