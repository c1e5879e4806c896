"""Logits processors that depend on the tokens generated so far, applied per verified position.

`repetition_penalty` (tokens of the prompt and output: positive logits divided by it, negative
ones multiplied), `presence_penalty` / `frequency_penalty` (OpenAI: minus presence for every output
token seen, minus frequency times its count), `logit_bias`, `allowed_token_ids`, `bad_words` (a
word's last token is banned when the text ends with the rest of it) and `min_tokens` (no stop
token before that many output tokens).

Plain decoding applies them to the one row it samples, with the history of everything generated.
A speculative step verifies several rows at once, so row j of a draft must see the history *plus
the drafts before it* (its path from the root, for trees): the counts, the ban on a bad word's last
token and the min-tokens rule all move with the path. `apply_logits_processors` builds each row's
history that way, so verification accepts exactly what plain decoding would have produced."""
from __future__ import annotations

import torch

_NEG = float("-inf")


def needs_processing(params) -> bool:
    return bool(params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0
                or params.logit_bias or params.allowed_token_ids is not None or params.bad_words
                or params.min_tokens)


def process_row(logits: torch.Tensor, params, prompt: list[int], output: list[int], stop_ids,
                bad_words_ids=(), seen: set | None = None) -> None:
    """Apply the request's processors in place to one row of logits [V] whose history is `prompt`
    then `output` (the generated tokens including the draft path before this row). `seen`: the
    distinct tokens of that history, when the caller has them (one set per request, not per row)."""
    V = logits.shape[-1]
    dev = logits.device
    if params.repetition_penalty != 1.0:
        if seen is None:
            seen = set(prompt) | set(output)
        seen = torch.tensor(sorted(seen), dtype=torch.long, device=dev)
        if seen.numel():
            vals = logits[seen]
            logits[seen] = torch.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and output:
        counts = torch.bincount(torch.tensor(output, dtype=torch.long, device=dev), minlength=V)[:V].to(logits.dtype)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=dev)
        logits[ids] += torch.tensor(list(params.logit_bias.values()), dtype=logits.dtype, device=dev)
    if params.allowed_token_ids is not None:
        keep = torch.zeros(V, dtype=torch.bool, device=dev)
        keep[torch.tensor(params.allowed_token_ids, dtype=torch.long, device=dev)] = True
        logits.masked_fill_(~keep, _NEG)
    for word in bad_words_ids:
        prefix = word[:-1]
        if not prefix or (len(output) >= len(prefix) and output[len(output) - len(prefix):] == prefix):
            logits[word[-1]] = _NEG
    if params.min_tokens and len(output) < params.min_tokens and stop_ids:
        logits[torch.tensor(list(stop_ids), dtype=torch.long, device=dev)] = _NEG


def _paths(draft) -> list[list[int]]:
    """Per draft node, the tokens from the root's child down to it (its path)."""
    out: list[list[int]] = []
    for tok, p in zip(draft.token_ids, draft.parents):
        out.append((out[p] if p >= 0 else []) + [tok])
    return out


def apply_logits_processors(logits: torch.Tensor, scheds) -> None:
    """In place, for the scheduled requests whose sampling parameters need it. Rows are laid out per
    request as verification reads them: the root, then the draft nodes."""
    row = 0
    for s in scheds:
        n = s.num_draft_tokens + 1
        req = s.request
        if s.completes_prompt and req.needs_logits_processing:
            stop_ids = tuple(req.eos_token_ids) + tuple(req.params.stop_token_ids)
            out = req.output_token_ids
            bad = req.bad_words_ids
            # the history's distinct tokens once per request; each draft row adds its path
            seen = set(req.all_token_ids) if req.params.repetition_penalty != 1.0 else None
            process_row(logits[row], req.params, req.prompt_token_ids, out, stop_ids, bad, seen)
            if s.draft is not None:
                for j, path in enumerate(_paths(s.draft)):
                    process_row(logits[row + 1 + j], req.params, req.prompt_token_ids, out + path, stop_ids, bad,
                                seen | set(path) if seen is not None else None)
        row += n
