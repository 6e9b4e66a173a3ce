"""A steady client load against a server: per-request results, for continuity checks."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

import httpx

DEFAULT_PROMPTS = (
    "the expert rank",
    "hello world question",
    "scale up down grow",
    "router layer cluster server",
    "one two three four",
    "elastic orchestrator kubernetes",
    "drain commit phase status",
    "red green blue token",
)


# What the server's 503s for a fault say: the request's own shard died (the tokenizer's
# LOST_WITH_SHARD), or a peer rank died during its forward (pass_faults).
LOST_TO_A_FAULT = ("failed before it finished", "failed during this request's forward pass")


def most_lost_to_a_kill(concurrency: int) -> int:
    """How many requests one kill may cost a load of ``concurrency`` clients: each client's
    request in flight at the kill, and each client's next one, sent before every survivor's
    data plane had masked the dead rank (a survivor whose last pass was idle masks it only in
    its next MoE forward, which then ran without it and is ended too)."""
    return 2 * concurrency


@dataclass
class RequestResult:
    prompt: str
    started: float
    finished: float
    status: int  # HTTP status, 0 when the request never got an answer
    output_ids: list[int] = field(default_factory=list)
    dp_rank: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    @property
    def lost_to_a_fault(self) -> bool:
        """Ended with 503 by a rank's failure, as the server promises: the shard running it
        died, or a peer died during its forward on a live shard."""
        return self.status == 503 and any(m in (self.error or "") for m in LOST_TO_A_FAULT)


def generate(
    client: httpx.Client, url: str, prompt: str, max_new_tokens: int = 8, timeout_s: float = 120
) -> RequestResult:
    started = time.monotonic()
    body = {
        "text": prompt,
        "sampling_params": {
            "max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True
        },
    }
    try:
        resp = client.post(url + "/generate", json=body, timeout=timeout_s)
    except httpx.HTTPError as exc:
        return RequestResult(prompt, started, time.monotonic(), 0, error=repr(exc))
    finished = time.monotonic()
    if resp.status_code != 200:
        return RequestResult(prompt, started, finished, resp.status_code, error=resp.text[:500])
    data = resp.json()
    meta = data.get("meta_info", {})
    finish = meta.get("finish_reason") or {}
    error = finish.get("message") if finish.get("type") == "abort" else None
    return RequestResult(
        prompt, started, finished, 200, list(data.get("output_ids", [])), meta.get("dp_rank"), error
    )


def greedy_reference(
    url: str, prompts: tuple[str, ...] = DEFAULT_PROMPTS, max_new_tokens: int = 8
) -> dict[str, list[int]]:
    """Token ids of each prompt's greedy completion: what every later answer must equal."""
    outputs = {}
    with httpx.Client() as client:
        for prompt in prompts:
            result = generate(client, url, prompt, max_new_tokens)
            if not result.ok:
                raise RuntimeError(f"reference request failed: {result.status} {result.error}")
            outputs[prompt] = result.output_ids
    return outputs


class LoadClient:
    """``concurrency`` threads each sending greedy requests back to back until stopped."""

    def __init__(
        self,
        url: str,
        prompts: tuple[str, ...] = DEFAULT_PROMPTS,
        concurrency: int = 2,
        max_new_tokens: int = 8,
        pause_s: float = 0.05,
    ) -> None:
        self.url = url
        self.prompts = prompts
        self.concurrency = concurrency
        self.max_new_tokens = max_new_tokens
        self.pause_s = pause_s
        self.results: list[RequestResult] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def _worker(self, index: int) -> None:
        with httpx.Client() as client:
            i = index
            while not self._stop.is_set():
                prompt = self.prompts[i % len(self.prompts)]
                result = generate(client, self.url, prompt, self.max_new_tokens)
                with self._lock:
                    self.results.append(result)
                i += self.concurrency
                self._stop.wait(self.pause_s)

    def start(self) -> LoadClient:
        for i in range(self.concurrency):
            thread = threading.Thread(target=self._worker, args=(i,), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> list[RequestResult]:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=180)
        return self.snapshot()

    def snapshot(self) -> list[RequestResult]:
        with self._lock:
            return list(self.results)

    def __enter__(self) -> LoadClient:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def longest_gap(results: list[RequestResult], start: float, end: float) -> float:
    """Longest time between consecutive successful completions within [start, end]."""
    times = sorted(r.finished for r in results if r.ok and start <= r.finished <= end)
    points = [start, *times, end]
    return max(b - a for a, b in zip(points, points[1:], strict=False))


def stream_on_shard(url: str, shard: int, max_new_tokens: int, running: threading.Event,
                    timeout_s: float) -> list[dict]:
    """A greedy request pinned to ``shard``, streamed: ``running`` is set once its first token
    came (it runs there). Every chunk it sent, the last one with the totals; a refused request
    is one chunk ``{"status", "error"}``."""
    body = {"text": "a long answer", "routed_dp_rank": shard, "stream": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0,
                                "ignore_eos": True}}
    chunks: list[dict] = []
    with httpx.stream("POST", url + "/generate", json=body, timeout=timeout_s) as resp:
        if resp.status_code != 200:
            return [{"status": resp.status_code, "error": resp.read().decode(errors="replace")}]
        for line in resp.iter_lines():
            if line.startswith("data:") and line.strip() != "data: [DONE]":
                chunks.append(json.loads(line[5:]))
                running.set()
    return chunks
