"""`pagedserve bench`: an OpenAI-API load generator and its reports (asyncio; the load goes
through a bare HTTP/1.1 client, `pagedserve.cli.bench.client`)."""
