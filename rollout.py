"""Multi-turn agentic rollouts: the policy thinks, calls the Python tool, reads the result, and answers.

Implements section 2 of rstar2-agent.md (the protocol lives in `protocol.py`; this file plays it out):

    prompt = system + user(problem) + "<|im_start|>assistant\\n<reason>"
    repeat:  the policy samples one turn, up to and including <|im_end|>            (loss mask 1)
             no <tool_call> in the turn            -> end_reason "answer"
             a <tool_call> in turn number max_turns -> not executed, end_reason "max_turns"
             else the first call runs in the code tool; its rendered result is appended as
             tool_response_turn(text) = "\\n<|im_start|>user\\n<tool_response>..." + "<|im_start|>assistant\\n<reason>"
                                                                                    (loss mask 0)
- Token in, token out: sampled ids are kept exactly as sampled; each environment text is tokenized on its own
  (`tokenizer.encode(text, add_special_tokens=False)`) and appended. The history is never decoded and re-tokenized.
- One budget, `max_response_tokens`, covers everything after the prompt (sampled turns and tool text). A turn that
  runs out of budget ends the rollout with "length". A tool response that would overflow the budget is NOT
  appended (neither whole nor in part) and the rollout ends with "length"; that call still counts as made.
- A malformed call (bad JSON, unknown tool, bad arguments; see `protocol.parse_tool_call`) is not run: its error
  text is the tool response and it counts as a failed call, as does any ToolResult that is not "ok".
- Truncated rollouts ("length", "max_turns") are kept; the caller scores them (usually reward 0).

Scheduling: all rollouts of a step advance together. Each round generates one turn for every unfinished rollout in
one sampler call, then submits that round's tool calls to the code tool (`tool.submit`, concurrent workers).
With `overlap=True` the rollouts are split into two halves that take turns: while one half generates, the other
half's tool calls run, so tool time hides behind generation. This is a scaled-down form of the report's
asynchronous tool dispatch (section 8), not its KV-cache-aware load balancer. Finished rollouts drop out.
bench/rollout.py measures both settings: on the CPU the tool's share of the wall time is about 1% either way (the
calls are short and run in worker processes), so the overlap matters where generation is fast (GPUs) or calls slow.

Left out: more than one call per turn (only the first runs, as the report says), per-turn token limits, and
re-using the KV cache across turns (each turn re-reads the whole context; vLLM's prefix cache recovers that).
"""
from dataclasses import asdict, dataclass, field

from tqdm import tqdm

from protocol import ChatFormat, ToolCall, count_answer_blocks, parse_tool_call, tool_response_turn

END_REASONS = ("answer", "max_turns", "length")
PARSE_ERROR = "parse_error"  # ToolCallRecord.status of a call that could not be parsed, so it never ran


@dataclass
class ToolCallRecord:
    """One tool call as made: what ran and what the model was shown."""
    code: str
    stdin: str
    response: str  # the text inside <tool_response> (ToolResult.render() or the parse error)
    status: str  # ToolResult.status ("ok", "error", "timeout", "memory", ...) or "parse_error"

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass
class Trajectory:
    """One problem played out. Token lists are aligned: response_ids[t], loss_mask[t], logprobs[t].

    loss_mask[t] = 1 exactly on tokens the policy sampled (its turns, each ending with its <|im_end|>);
    0 on environment text (tool responses and the re-opened assistant header). Prompt tokens carry no mask."""
    problem: str
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    # Sampler log-probs of the sampled tokens, 0.0 where the mask is 0; None if the sampler gives none.
    logprobs: list[float] | None = field(default_factory=list)
    turns: list[str] = field(default_factory=list)  # decoded text of the model's own turns (no <|im_end|>)
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    end_reason: str | None = None  # one of END_REASONS once finished
    reward: float = 0.0  # set by the caller (reward.py), never by the rollout

    @property
    def text(self) -> str:
        """The model's own text only, for answer extraction: tool output is never part of it."""
        return "".join(self.turns)

    @property
    def num_turns(self) -> int:
        return len(self.turns)

    @property
    def num_tool_calls(self) -> int:
        return len(self.tool_calls)

    @property
    def num_failed_tool_calls(self) -> int:
        return sum(not c.ok for c in self.tool_calls)

    @property
    def num_answer_blocks(self) -> int:
        return count_answer_blocks(self.text)

    @property
    def truncated(self) -> bool:
        return self.end_reason != "answer"

    def to_dict(self) -> dict:
        """A JSON-ready record (one JSONL line), with the counts spelled out."""
        d = asdict(self)
        for key in ("text", "num_turns", "num_tool_calls", "num_failed_tool_calls", "num_answer_blocks", "truncated"):
            d[key] = getattr(self, key)
        return d


def append_sampled(traj: Trajectory, completion) -> None:
    """Append tokens the policy sampled (loss mask 1) with their log-probs."""
    traj.response_ids += completion.token_ids
    traj.loss_mask += [1] * len(completion.token_ids)
    if traj.logprobs is not None and completion.logprobs is not None:
        traj.logprobs += completion.logprobs
    else:
        traj.logprobs = None


def end_turn(traj: Trajectory, turn_text: str, stopped: bool, max_turns: int) -> ToolCall | None:
    """Close the current turn. Returns the tool call to execute, or None when the rollout ended (then `end_reason`
    is set). stopped: the turn ended with its stop token (else it ran out of the response budget)."""
    traj.turns.append(turn_text)
    if not stopped:
        traj.end_reason = "length"
        return None
    call = parse_tool_call(turn_text)
    if call is None:
        traj.end_reason = "answer"
    elif traj.num_turns >= max_turns:  # the last allowed turn may not call the tool
        traj.end_reason = "max_turns"
        call = None
    return call


def append_tool_response(traj: Trajectory, call: ToolCall, result, tokenizer, max_response_tokens: int) -> None:
    """Record the call and append its environment text (loss mask 0), or end with "length" if it does not fit.
    result: the ToolResult, or None for a call that failed to parse."""
    if call.error is not None:
        text, status = call.error, PARSE_ERROR
    else:
        text, status = result.render(), result.status
    traj.tool_calls.append(ToolCallRecord(call.code, call.stdin, text, status))
    ids = tokenizer.encode(tool_response_turn(text), add_special_tokens=False)
    if len(traj.response_ids) + len(ids) > max_response_tokens:
        traj.end_reason = "length"  # it does not fit: nothing of it is appended
        return
    traj.response_ids += ids
    traj.loss_mask += [0] * len(ids)
    if traj.logprobs is not None:
        traj.logprobs += [0.0] * len(ids)
    if len(traj.response_ids) == max_response_tokens:
        traj.end_reason = "length"  # it fits exactly: no room left for another turn


def _decode_turn(tokenizer, ids: list[int], stopped: bool) -> str:
    """Text of one sampled turn, without the stop token that closed it (<|im_end|>)."""
    ids = ids[:-1] if stopped else ids
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def rollout(problems: list[str], sampler, tool, tokenizer, fmt: ChatFormat, max_response_tokens: int,
            max_turns: int, temperature: float = 1.0, top_p: float = 1.0, overlap: bool = True,
            progress: bool = False) -> list[Trajectory]:
    """Play out every problem (N = len(problems); repeat a problem 2G times for a group) and return N Trajectories
    in the same order. sampler: see sampler.py; tool: a CodeTool (only `submit` is used)."""
    trajs = [Trajectory(p, tokenizer.encode(fmt.prompt(p), add_special_tokens=False)) for p in problems]
    n_groups = 2 if overlap and len(trajs) > 1 else 1
    groups = [list(range(g, len(trajs), n_groups)) for g in range(n_groups)]
    in_flight: list[list] = [[] for _ in groups]  # per group: (index, ToolCall, Future | None) from its last turn
    bar = tqdm(total=len(trajs), desc="rollouts", unit="rollout", disable=not progress)
    while any(groups):
        for g in range(n_groups):
            # 1. Tool results of this group's previous turn (they ran while the other group generated).
            for i, call, future in in_flight[g]:
                result = None if future is None else future.result()
                append_tool_response(trajs[i], call, result, tokenizer, max_response_tokens)
            in_flight[g] = []
            done = [i for i in groups[g] if trajs[i].end_reason is not None]
            groups[g] = [i for i in groups[g] if trajs[i].end_reason is None]
            bar.update(len(done))
            if not groups[g]:
                continue
            # 2. One turn for every unfinished rollout of the group, in one sampler call.
            active = [trajs[i] for i in groups[g]]
            completions = sampler.generate([t.prompt_ids + t.response_ids for t in active],
                                           [max_response_tokens - len(t.response_ids) for t in active],
                                           temperature, top_p)
            # 3. Record the turns and submit their tool calls; results are collected on the group's next visit.
            for i, traj, c in zip(groups[g], active, completions):
                append_sampled(traj, c)
                call = end_turn(traj, _decode_turn(tokenizer, c.token_ids, c.stopped), c.stopped, max_turns)
                if call is not None:
                    future = tool.submit(call.code, call.stdin) if call.error is None else None
                    in_flight[g].append((i, call, future))
    bar.close()
    return trajs


def rollout_sums(trajs, rewards) -> dict:
    """Per-rollout diagnostics (rstar2-agent.md section 4) as {name: (sum, count)}, so data-parallel ranks can
    add them up exactly before dividing (`means`). rewards: one 0/1 reward per trajectory."""
    pos = [t for t, r in zip(trajs, rewards) if r > 0]
    calls = sum(t.num_tool_calls for t in trajs)
    return {
        "reward_mean": (sum(rewards), len(rewards)),
        "response_tokens_mean": (sum(len(t.response_ids) for t in trajs), len(trajs)),
        "truncated_frac": (sum(t.truncated for t in trajs), len(trajs)),
        "tool_calls_mean": (calls, len(trajs)),
        "tool_error_rate": (sum(t.num_failed_tool_calls for t in trajs), calls),
        "tool_error_rate_in_correct": (sum(t.num_failed_tool_calls for t in pos), sum(t.num_tool_calls for t in pos)),
        "no_tool_frac": (sum(t.num_tool_calls == 0 for t in trajs), len(trajs)),
        "answer_tags_mean": (sum(t.num_answer_blocks for t in trajs), len(trajs)),
        "turns_mean": (sum(t.num_turns for t in trajs), len(trajs)),
    }


def means(sums: dict) -> dict:
    """{name: (sum, count)} -> {name: sum / count}, NaN where nothing was counted (e.g. no tool calls)."""
    return {k: (s / c if c else float("nan")) for k, (s, c) in sums.items()}
