"""`deploykit bench`: load-test any OpenAI-compatible endpoint, a deployment, or a sweep of a spec's placements.

client (one streamed request, a concurrency level; stream is its wire) -> stats (percentiles, throughput) -> report
(table, JSON, --compare) and plot (PNG); prompts makes the synthetic prompts, target finds the endpoint (URL,
deployment) and its replicas' /metrics, candidates lists the placements the planner can make, sweep brings each up
and measures it, command ties them to the CLI. httpx, httptools, uvloop, rich and matplotlib are imported only
here, never by the rest of deploykit.
"""
