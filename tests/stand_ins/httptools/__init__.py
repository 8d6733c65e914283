"""A stand-in for httptools beside the infinity-emb stand-in: Infinity's server runs uvicorn with
http="httptools", so bench/serve.py checks that --infinity's Python can import it before it starts
anything; the stand-in server (aiohttp) does not use it."""
