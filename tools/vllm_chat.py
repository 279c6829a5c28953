"""vLLM's own offline generate (`vllm.LLM.chat`), turn by turn, for comparing `regenerate --backend openai` with it.

Run with the engine venv's python (tools/engine_venv.sh), not the project's:
    VENV/bin/python tools/vllm_chat.py --model TARGET --input in.jsonl --out out.jsonl --max-tokens 32 \
        --settings '[{"temperature": 0}, {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "seed": 3}]'
Each input line is `{"index": i, "messages": [...]}`; every assistant turn is rewritten from the turns before it,
as `regenerate` does, with the request's seed `seed + index` (what the OpenAI backend sends). One output line per
setting and record: `{"setting": s, "index": i, "messages": [...]}`.
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--input", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-tokens", type=int, required=True)
    parser.add_argument("--settings", required=True, help="JSON list of {temperature, top_p, top_k, seed}")
    parser.add_argument("--max-model-len", type=int, default=1024)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    records = [json.loads(line) for line in open(args.input)]
    llm = LLM(model=args.model, dtype="float32", enforce_eager=True, max_model_len=args.max_model_len)
    rows = []
    for s, setting in enumerate(json.loads(args.settings)):
        conversations = [[dict(m) for m in r["messages"]] for r in records]
        slots = [[i for i, m in enumerate(msgs) if m["role"] == "assistant"] for msgs in conversations]
        for turn in range(max(map(len, slots))):
            todo = [(k, s_[turn]) for k, s_ in enumerate(slots) if turn < len(s_)]
            params = []
            for k, _ in todo:
                sampled = setting.get("temperature", 0) > 0
                params.append(SamplingParams(
                    max_tokens=args.max_tokens, temperature=setting.get("temperature", 0.0),
                    top_p=setting.get("top_p", 1.0) if sampled else 1.0,
                    top_k=(setting.get("top_k", 0) or -1) if sampled else -1,
                    seed=setting.get("seed", 0) + records[k]["index"] if sampled else None))
            outputs = llm.chat([conversations[k][:i] for k, i in todo], params,
                               chat_template_kwargs={"enable_thinking": False}, use_tqdm=False)
            for (k, i), output in zip(todo, outputs, strict=True):
                conversations[k][i] = {"role": "assistant", "content": output.outputs[0].text}
        rows += [{"setting": s, "index": r["index"], "messages": c}
                 for r, c in zip(records, conversations, strict=True)]
    with open(args.out, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)


if __name__ == "__main__":
    main()
