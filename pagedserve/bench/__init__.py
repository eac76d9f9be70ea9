"""`pagedserve bench`: an OpenAI-API load generator and its reports (asyncio + httpx)."""
