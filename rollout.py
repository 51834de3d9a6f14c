"""Multi-turn agentic rollouts: the policy thinks, calls the Python tool, reads the result, and answers.

Implements the report's multi-turn rollout (§2; the protocol lives in `protocol.py`; this file plays it out):

    prompt = system + user(problem) + "<|im_start|>assistant\\n<reason>"
    repeat:  the policy samples one turn, up to and including <|im_end|>            (loss mask 1)
             no <tool_call> in the turn            -> end_reason "answer"
             a <tool_call> in turn number max_turns -> not executed, end_reason "max_turns"
             else the first call runs in the code tool; its rendered result is appended as
             tool_response_turn(text) = "\\n<|im_start|>user\\n<tool_response>..." + "<|im_start|>assistant\\n<reason>"
                                                                                    (loss mask 0)
- Token in, token out: sampled ids are kept exactly as sampled; each environment text is tokenized on its own
  (`protocol.encode`: its markup with the control tokens, the tool's output and the problem as ordinary text, so a
  program cannot print an end of turn) and appended. The history is never decoded and re-tokenized.
- One budget, `max_response_tokens`, covers everything after the prompt (sampled turns and tool text). A turn that
  runs out of budget ends the rollout with "length". A tool response that would overflow the budget is NOT
  appended (neither whole nor in part) and the rollout ends with "length"; that call still counts as made.
- A malformed call (bad JSON, unknown tool, bad arguments; see `protocol.parse_tool_call`) is not run: its error
  text is the tool response and it counts as a failed call, as does any ToolResult that is not "ok".
- Truncated rollouts ("length", "max_turns") are kept; the caller scores them (usually reward 0).

Scheduling (the report's asynchronous tool dispatch, §3, on one engine): every rollout is a request on the
sampler (`add`), which batches them continuously. When a turn finishes (`step`), its tool call is submitted to the
code tool at once (`tool.submit`, concurrent workers); when the result is back, the conversation is added again and
joins the running batch on the next step, while the others keep generating. So tool time hides behind generation
and nobody waits for the longest turn of a round. With `sync_turns=True` every turn instead waits for all tool
calls of the batch before generation goes on: which requests share a step (and so, under a fixed seed, what is
sampled) then does not depend on how fast the tool answered; slower, for exact reruns. Across ranks, `more` takes
further prompts as rollouts end (schedule.py claims them from the step's shared counter).

`trajectory_record` writes a finished rollout as one readable JSON line, without token ids (eval.py's
trajectories.jsonl, the RL stage's saved rollouts); `rollout_sums` its statistics for the log.

Left out: more than one call per turn (only the first runs, as the report says) and per-turn token limits.
"""
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import asdict, dataclass, field

from tqdm import tqdm

from protocol import RESULT_FORMATS, ChatFormat, ToolCall, count_answer_blocks, encode
from reward import extract_answer

END_REASONS = ("answer", "max_turns", "length")
PARSE_ERROR = "parse_error"  # ToolCallRecord.status of a call that could not be parsed, so it never ran


@dataclass
class ToolCallRecord:
    """One tool call as made: what ran and what the model was shown."""
    code: str
    stdin: str
    response: str  # the text inside <tool_response> (the ToolResult as the format writes it, or the parse error)
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


def end_turn(traj: Trajectory, turn_text: str, stopped: bool, max_turns: int, fmt: ChatFormat) -> ToolCall | None:
    """Close the current turn. Returns the tool call to execute, or None when the rollout ended (then `end_reason`
    is set). stopped: the turn ended with its stop token (else it ran out of the response budget)."""
    traj.turns.append(turn_text)
    if not stopped:
        traj.end_reason = "length"
        return None
    call = fmt.parse_tool_call(turn_text)
    if call is None:
        traj.end_reason = "answer"
    elif traj.num_turns >= max_turns:  # the last allowed turn may not call the tool
        traj.end_reason = "max_turns"
        call = None
    return call


def append_tool_response(traj: Trajectory, call: ToolCall, result, tokenizer, max_response_tokens: int,
                         fmt: ChatFormat) -> None:
    """Record the call and append its environment text (loss mask 0), or end with "length" if it does not fit.
    result: the ToolResult, or None for a call that failed to parse."""
    if call.error is not None:
        text, status = call.error, PARSE_ERROR
    else:
        text, status = RESULT_FORMATS[fmt.tool_result_format](result), result.status
    traj.tool_calls.append(ToolCallRecord(call.code, call.stdin, text, status))
    ids = encode(tokenizer, fmt.tool_response_turn(text))
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
            max_turns: int, temperature: float = 1.0, top_p: float = 1.0, sync_turns: bool = False,
            progress: bool = False, more=None, seeds=None) -> list[Trajectory]:
    """Play out every problem (repeat a problem 2G times for a group) and return one Trajectory per problem, in
    order. sampler: see samplers/interface.py (`add`, `step`, `has_work`); tool: a CodeTool (only `submit`).
    more(running) -> list[str]: further problems, asked at the start and after every engine step (again after
    each non-empty answer), with the number of rollouts not yet ended ([] for none now); their trajectories follow, in the order given (schedule.py). Being
    asked is also the rank's sign of progress (accel.Peers).
    seeds(i, turn) -> the sampling seed of trajectory i's turn (schedule.Claims.seed); None: the sampler's own RNG."""
    trajs: list[Trajectory] = []
    running = 0  # rollouts not yet ended
    in_flight: dict[Future, tuple[int, ToolCall]] = {}  # tool calls submitted, not yet read
    bar = tqdm(total=0, desc="rollouts", unit="rollout", disable=not progress)

    def start(new: list[str]) -> None:
        nonlocal running
        for p in new:
            trajs.append(Trajectory(p, encode(tokenizer, fmt.prompt(p))))
            i = len(trajs) - 1
            sampler.add(i, trajs[i].prompt_ids, max_response_tokens, temperature, top_p, seeds and seeds(i, 0))
        running += len(new)
        bar.total += len(new)

    def claim() -> None:  # asked again after what it gave, until it gives nothing
        while more is not None and (extra := more(running)):
            start(extra)

    def go_on(i: int) -> None:
        """After a turn or a tool response: the rollout continues as a new request, or it has ended."""
        nonlocal running
        traj = trajs[i]
        if traj.end_reason is None:
            sampler.add(i, traj.prompt_ids + traj.response_ids, max_response_tokens - len(traj.response_ids),
                        temperature, top_p, seeds and seeds(i, traj.num_turns))
        else:
            running -= 1
            bar.update(1)

    start(list(problems))
    claim()
    while running:
        # 1. Generate: the turns that finished in this step are recorded; their tool calls start at once.
        for i, c in sampler.step() if sampler.has_work() else []:
            append_sampled(trajs[i], c)
            call = end_turn(trajs[i], _decode_turn(tokenizer, c.token_ids, c.stopped), c.stopped, max_turns, fmt)
            if call is not None and call.error is None:
                in_flight[tool.submit(call.code, call.stdin)] = (i, call)
                continue
            if call is not None:  # a malformed call never reaches the tool: its error is the response
                append_tool_response(trajs[i], call, None, tokenizer, max_response_tokens, fmt)
            go_on(i)
        # 2. Read the tool results that are back; with nothing left to generate, wait for them.
        if sync_turns:
            ready = [] if sampler.has_work() else list(wait(in_flight).done)
        elif sampler.has_work():
            ready = [f for f in in_flight if f.done()]
        else:
            ready = list(wait(in_flight, return_when=FIRST_COMPLETED).done) if in_flight else []
        for future in sorted(ready, key=lambda f: in_flight[f][0]):  # a fixed order of re-adding
            i, call = in_flight.pop(future)
            append_tool_response(trajs[i], call, future.result(), tokenizer, max_response_tokens, fmt)
            go_on(i)
        claim()
    bar.close()
    return trajs


def trajectory_record(benchmark: str, problem: dict, problem_index: int, sample: int, traj) -> dict:
    """One line of a trajectories.jsonl (eval.py's, and the RL stage's saved rollouts): everything needed to read
    the rollout, without token ids."""
    return {
        "benchmark": benchmark, "problem_index": problem_index, "sample": sample, "id": problem.get("id"),
        "problem": problem["problem"], "answer": problem["answer"], "pred": extract_answer(traj.text),
        "reward": traj.reward, "end_reason": traj.end_reason, "truncated": traj.truncated,
        "response_tokens": len(traj.response_ids), "sampled_tokens": sum(traj.loss_mask),
        "num_turns": traj.num_turns, "num_tool_calls": traj.num_tool_calls,
        "num_failed_tool_calls": traj.num_failed_tool_calls, "num_answer_blocks": traj.num_answer_blocks,
        "turns": traj.turns,
        "tool_calls": [{"code": c.code, "stdin": c.stdin, "status": c.status, "response": c.response}
                       for c in traj.tool_calls],
    }


def rollout_sums(trajs, rewards) -> dict:
    """Per-rollout diagnostics (the report's training curves) as {name: (sum, count)}, so data-parallel ranks can
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
