"""The OpenAI-compatible backend of `regenerate`: every assistant turn through a serving engine's chat-completions
endpoint (vLLM, SGLang, `transformers serve`), many conversations in flight over one or more servers.
"""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from dflash_lightning.data.conversations import Message
from dflash_lightning.errors import first_line
from dflash_lightning.regenerate.output import Conversation, OrderedWriter

# Records finished ahead of the oldest unfinished one wait in memory until it is written: at most this many per
# conversation in flight (a long conversation at the head stalls new ones only after that).
WINDOW_PER_SLOT = 16


class ServerError(RuntimeError):
    """A server that cannot be used at all (unreachable, refusing the settings): the run stops, resumable."""


class RecordFailure(Exception):
    """A record the server could not answer: it goes to the rejects file."""

    def __init__(self, reason: str, detail: str) -> None:
        self.reason, self.detail = reason, detail
        super().__init__(f"{reason}: {detail}")


def request_fields(*, max_new_tokens: int, temperature: float, top_p: float, top_k: int, stop: Sequence[str],
                   template_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The chat-completions fields that carry the target's sampling settings, as vLLM and SGLang take them."""
    fields: dict[str, Any] = {"max_tokens": max_new_tokens, "temperature": temperature}
    extra: dict[str, Any] = {}
    if temperature > 0:
        # sent explicitly: vLLM would otherwise take them from the model's generation_config.json
        fields["top_p"] = top_p
        extra["top_k"] = top_k if top_k > 0 else -1  # -1: off, in vLLM and SGLang
    if stop:
        fields["stop"] = list(stop)
    if template_kwargs:
        extra["chat_template_kwargs"] = dict(template_kwargs)
    if extra:
        fields["extra_body"] = extra
    return fields


def run_coroutine(coroutine: Any) -> Any:
    """`asyncio.run`, also from a notebook, whose own event loop runs in this thread: then in a thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def said(err: Any) -> str:
    """What a server answered to a failed request: the client's message and the body it came with."""
    body = getattr(err, "body", None)
    return err.message if body is None or str(body) in err.message else f"{err.message}: {body}"


class Server:
    """One OpenAI-compatible server: its async client and how many conversations it holds now."""

    def __init__(self, url: str, api_key: str, timeout: float, max_retries: int) -> None:
        import openai

        self.url, self.max_retries, self.timeout = url, max_retries, timeout
        self.client = openai.AsyncOpenAI(base_url=url, api_key=api_key, timeout=timeout, max_retries=max_retries)
        self.in_flight = 0

    async def models(self) -> dict[str, str | None]:
        """`{model id: owned_by}` of what the server lists at /models."""
        import openai

        try:
            raw = await self.client.models.with_raw_response.list()
        except openai.APITimeoutError as err:  # a wedged server: it takes the connection and never answers
            raise ServerError(f"{self.url}/models gave no answer within {self.timeout:g} s, {self.max_retries + 1} "
                              "tries; is the server still loading, or wedged?") from err
        except openai.APIConnectionError as err:
            raise ServerError(f"cannot reach {self.url} ({err.__cause__ or err}); is the server up?") from err
        except openai.APIStatusError as err:
            raise ServerError(f"{self.url}/models answered HTTP {err.status_code}: {said(err)}") from err
        try:
            page = raw.parse()
        except (openai.APIError, ValueError, AttributeError) as err:  # not JSON; not even said to be (AttributeError)
            raise ServerError(f"{self.url}/models answered {first_line(raw.text)}, not a JSON list of models; is it "
                              "an OpenAI-compatible API root?") from err
        data = getattr(page, "data", None)
        if not isinstance(data, list) or not all(isinstance(getattr(m, "id", None), str) for m in data):
            raise ServerError(f"{self.url}/models did not answer a list of models: {page!r:.200}")
        return {m.id: getattr(m, "owned_by", None) for m in data}

    async def answer(self, model: str, messages: list[Message], fields: dict[str, Any]) -> tuple[str, bool, int]:
        """`(text, truncated, generated tokens)` of the server's answer to one conversation prefix."""
        import openai
        from openai.types.chat import ChatCompletion

        try:
            response = await self.client.chat.completions.create(model=model, messages=messages, **fields)
        except openai.APITimeoutError as err:
            raise RecordFailure("timed out", f"{self.url}: no answer within {self.timeout:g} s, "
                                             f"{self.max_retries + 1} tries") from err
        except openai.APIConnectionError as err:
            raise ServerError(f"lost {self.url} ({err.__cause__ or err}) after {self.max_retries} retries; the "
                              "lines written so far are kept: run the same command again to resume") from err
        except (openai.AuthenticationError, openai.PermissionDeniedError, openai.NotFoundError,
                openai.UnprocessableEntityError) as err:
            # the same for every record: a wrong key, model or sampling field
            raise ServerError(f"{self.url} refused the request: HTTP {err.status_code}: {said(err)}") from err
        except openai.APIStatusError as err:
            raise RecordFailure(f"HTTP {err.status_code}", f"{self.url}: {said(err)}") from err
        except (openai.APIError, ValueError) as err:  # ValueError: a body that is not JSON
            raise RecordFailure("malformed answer", f"{self.url}: {type(err).__name__}: {err}") from err
        choices = getattr(response, "choices", None) if isinstance(response, ChatCompletion) else None
        message = getattr(choices[0], "message", None) if isinstance(choices, list) and choices else None
        text = getattr(message, "content", None)
        if not isinstance(text, str):
            raise RecordFailure("malformed answer", f"{self.url}: no text in choices[0].message.content: "
                                                    f"{response!r:.300}")
        if getattr(message, "reasoning_content", None) or getattr(message, "reasoning", None):
            raise ServerError(f"{self.url} returns the thinking apart from the answer (a reasoning parser): start "
                              "it without one, so that the answer is all the target wrote")
        finish = getattr(choices[0], "finish_reason", None)
        if finish not in ("stop", "length"):
            raise RecordFailure(f"finish_reason {finish!r}", f"{self.url}: {response!r:.300}")
        usage = getattr(response, "usage", None)
        tokens = getattr(usage, "completion_tokens", None)
        return text, finish == "length", tokens if isinstance(tokens, int) else 0

    async def regenerate(self, model: str, messages: list[Message], fields: dict[str, Any],
                         counts: Counter[str]) -> None:
        """Rewrites every assistant turn in place, turn by turn: turn k is asked with the new turns < k."""
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            text, truncated, n = await self.answer(model, messages[:i], fields)
            messages[i] = {"role": "assistant", "content": text}
            counts["turns"] += 1
            counts["truncated turns"] += truncated
            counts["tokens"] += n
            counts[f"requests to {self.url}"] += 1


class Servers:
    """The OpenAI-compatible servers of a run: checked before any work, then sharing the conversations."""

    def __init__(self, base_urls: Sequence[str], api_key_env: str, timeout: float, max_retries: int) -> None:
        if not base_urls:
            raise ValueError("backend 'openai' needs --base_url: the server's API root, e.g. http://127.0.0.1:8000/v1")
        for url in base_urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"base_url {url!r}: expected http://HOST:PORT/v1")
        # vLLM and SGLang take any key unless started with --api-key; the client needs one all the same
        self.api_key = os.environ.get(api_key_env) or "EMPTY"
        self.urls, self.timeout, self.max_retries = list(base_urls), timeout, max_retries

    def _connect(self) -> list[Server]:
        return [Server(url, self.api_key, self.timeout, self.max_retries) for url in self.urls]

    def identify(self, target: str | None) -> tuple[str, str | None]:
        """`(model, engine)`: the model every server serves (`target`, or the one they list) and its `owned_by`."""

        async def ask() -> list[dict[str, str | None]]:
            servers = self._connect()
            try:
                return list(await asyncio.gather(*(s.models() for s in servers)))
            finally:
                await asyncio.gather(*(s.client.close() for s in servers))

        listed = run_coroutine(ask())
        if target is None:
            names = {name for models in listed for name in models}
            if len(names) != 1:
                raise ServerError(f"the servers {self.urls} serve {sorted(names)}: pass --target, the model to use")
            target = names.pop()
        for url, models in zip(self.urls, listed, strict=True):
            if target not in models:
                raise ServerError(f"{url} does not serve {target!r}; it serves {sorted(models)}")
        engines = {models[target] for models in listed}
        if len(engines) != 1:
            raise ServerError(f"the servers {self.urls} report different engines for {target!r}: {sorted(engines)}")
        return target, engines.pop()

    def run(self, conversations: Iterator[Conversation], writer: OrderedWriter, counts: Counter[str],
            done: Callable[[int], None], *, model: str, concurrency: int, abort_after: int, seed: int | None,
            **sampling: Any) -> None:
        """Regenerates the conversations, `concurrency` at once, each on the server holding the fewest now."""
        fields = request_fields(**sampling)
        run_coroutine(self._run(conversations, writer, counts, done, model, fields, concurrency, abort_after, seed))

    async def _run(self, conversations: Iterator[Conversation], writer: OrderedWriter, counts: Counter[str],
                   done: Callable[[int], None], model: str, fields: dict[str, Any], concurrency: int,
                   abort_after: int, seed: int | None) -> None:
        servers = self._connect()
        slots = asyncio.Semaphore(concurrency)
        advanced = asyncio.Event()
        writer.on_advance = advanced.set
        tasks: set[asyncio.Task] = set()
        fatal: list[BaseException] = []
        failed_in_a_row = 0
        sampled = "top_p" in fields and seed is not None  # a seed only means something when sampling

        def stop(err: BaseException) -> None:
            if not fatal:
                fatal.append(err)
                for task in tasks - {asyncio.current_task()}:
                    task.cancel()  # their records are not written: a rerun generates them again
            advanced.set()

        async def one(item: Conversation, server: Server) -> None:
            nonlocal failed_in_a_row
            index, location, record, messages = item
            request = fields | {"seed": seed + index} if sampled else fields
            try:
                try:
                    await server.regenerate(model, messages, request, counts)
                except RecordFailure as err:
                    writer.reject(index, location, err.reason, err.detail, record)
                    failed_in_a_row += 1
                    if abort_after and failed_in_a_row >= abort_after:
                        stop(ServerError(f"{failed_in_a_row} records in a row failed at the servers (the last: "
                                         f"{err}); see {writer.rejects_path}, fix the server and run the same "
                                         "command again to resume"))
                else:
                    failed_in_a_row = 0
                    writer.finish(index, location, record, messages)
                done(1)
            except Exception as err:  # noqa: BLE001 - anything else ends the run, raised by it below
                stop(err)
            finally:
                server.in_flight -= 1
                slots.release()

        try:
            for item in conversations:
                while item[0] - writer.next >= WINDOW_PER_SLOT * concurrency and not fatal:
                    advanced.clear()
                    await advanced.wait()
                await slots.acquire()
                if fatal:
                    break
                server = min(servers, key=lambda s: s.in_flight)  # its turns stay there: the prefix cache holds them
                server.in_flight += 1
                task = asyncio.create_task(one(item, server))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            await asyncio.gather(*list(tasks), return_exceptions=True)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*list(tasks), return_exceptions=True)
            await asyncio.gather(*(s.client.close() for s in servers), return_exceptions=True)
        if fatal:
            raise fatal[0]


__all__ = ["RecordFailure", "Server", "ServerError", "Servers", "request_fields"]
