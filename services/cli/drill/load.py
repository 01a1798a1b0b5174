"""Load for drills: sessions holding multi-turn conversations, streamed through the gateway's OpenAI API.

Every request is recorded (start, time to first token, end, status, the clusters that served it), so the
report can show TTFT and errors over time and where each session's turns went before and after a fault.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time

import aiohttp


@dataclasses.dataclass
class RequestRecord:
    session: str
    turn: int
    start: float
    ttft: float | None = None
    end: float | None = None
    status: int = 0
    error: str = ""
    # Clusters named by the stream's system_fingerprint (more than one after a mid-stream failover).
    clusters: list[str] = dataclasses.field(default_factory=list)
    tokens: int = 0
    # From the stream's usage chunk: the prompt the serving cluster prefilled, and how much came from cache.
    prompt_tokens: int = 0
    cached_tokens: int = 0
    # 0 for the first try; a client retry (after a retriable 429/503) is a new record with attempt + 1.
    attempt: int = 0

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error


@dataclasses.dataclass
class LoadSpec:
    sessions: int = 300
    turns: int = 3
    concurrency: int = 100
    max_tokens: int = 8
    think_time_s: float = 0.2
    # Each client retries a request that got a retriable error (429/503) this many times.
    client_retries: int = 3
    seed: int = 0


class LoadGenerator:
    def __init__(self, http_address: str, spec: LoadSpec, model: str = "nano", api_key: str = ""):
        self.url = f"http://{http_address}/v1/chat/completions"
        self.spec, self.model = spec, model
        self.headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.records: list[RequestRecord] = []
        self.t0 = 0.0
        self.done_sessions = 0

    def now(self) -> float:
        return time.monotonic() - self.t0

    def session_id(self, index: int) -> str:
        return f"drill-{self.spec.seed}-{index}"

    def session_ids(self) -> list[str]:
        return [self.session_id(i) for i in range(self.spec.sessions)]

    async def run(self, t0: float | None = None) -> list[RequestRecord]:
        """Run every session to its end; record times relative to `t0` (time.monotonic(), default now)."""
        self.t0 = time.monotonic() if t0 is None else t0
        gate = asyncio.Semaphore(self.spec.concurrency)
        timeout = aiohttp.ClientTimeout(total=300)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            await asyncio.gather(*(self._session(http, gate, i) for i in range(self.spec.sessions)))
        return self.records

    async def _session(self, http: aiohttp.ClientSession, gate: asyncio.Semaphore, index: int) -> None:
        rng = random.Random(self.spec.seed * 1_000_003 + index)
        session = self.session_id(index)
        messages = [{"role": "system", "content": f"You are session {index}."}]
        await asyncio.sleep(rng.random() * self.spec.think_time_s * 5)
        for turn in range(self.spec.turns):
            messages.append({"role": "user", "content": f"turn {turn}: tell me about {rng.randrange(10**6)}"})
            async with gate:
                record = await self._request(http, session, turn, messages)
            messages.append({"role": "assistant", "content": "ok"})
            if not record.ok:
                break
            await asyncio.sleep(rng.random() * self.spec.think_time_s)
        self.done_sessions += 1

    async def _request(self, http: aiohttp.ClientSession, session: str, turn: int,
                       messages: list[dict]) -> RequestRecord:
        body = {"model": self.model, "messages": messages, "max_tokens": self.spec.max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        headers = {**self.headers, "x-session-id": session}
        for attempt in range(self.spec.client_retries + 1):
            record = RequestRecord(session, turn, self.now(), attempt=attempt)
            self.records.append(record)
            try:
                await self._stream(http, body, headers, record)
            except (aiohttp.ClientError, TimeoutError) as exc:
                record.error = f"{type(exc).__name__}: {exc}"
            record.end = self.now()
            retriable = record.status in (429, 503) or (record.error and record.ttft is None)
            if record.ok or not retriable or attempt == self.spec.client_retries:
                return record
            await asyncio.sleep(0.2 * (attempt + 1))
        return record

    async def _stream(self, http: aiohttp.ClientSession, body: dict, headers: dict, record: RequestRecord) -> None:
        async with http.post(self.url, json=body, headers=headers) as reply:
            record.status = reply.status
            if reply.status != 200:
                record.error = (await reply.json(content_type=None)).get("error", {}).get("message", "")[:200]
                return
            async for raw in reply.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    record.error = chunk["error"]["message"][:200]
                    return
                if chunk.get("usage"):
                    record.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    details = chunk["usage"].get("prompt_tokens_details") or {}
                    record.cached_tokens = details.get("cached_tokens", 0)
                if not chunk.get("choices"):
                    continue
                if record.ttft is None:
                    record.ttft = self.now() - record.start
                cluster = chunk.get("system_fingerprint", "").removeprefix("k3:")
                if cluster and (not record.clusters or record.clusters[-1] != cluster):
                    record.clusters.append(cluster)
                record.tokens += sum(1 for c in chunk.get("choices", []) if c.get("delta", {}).get("content"))
