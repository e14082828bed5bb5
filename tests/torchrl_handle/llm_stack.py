"""torchrl's real LLM pieces on CPU for the handle's tests: a ``ChatEnv`` over a procedural dataset with a reward
transform, a ``TransformersWrapper(generate=True)`` policy over the tiny chat model of ``text_model.py``, an
``LLMCollector`` writing into a buffer, and a learner step with ``GRPOLoss``.

Each collector's env says who it is in its system prompt (``"collector N"``): the group key is the dataset's
question (``"query"``), so the system prompt tells which collector wrote a member of a group without adding a
key torchrl's specs would have to declare."""

from __future__ import annotations

import torch
from tensordict import TensorDict, lazy_stack, set_list_to_stack
from torchrl.data import Unbounded
from torchrl.envs import StepCounter, Transform

REWARDED = "aeiou"  # the reward: the share of the response's characters that are vowels


def vowel_share(text: str) -> float:
    """The reward of one response: the share of its characters that are in ``REWARDED``."""
    return sum(c in REWARDED for c in text) / max(len(text), 1)


def questions(n: int) -> list[dict]:
    return [{"query": f"what is {i} + {2 * i}?"} for i in range(n)]


def _collate(batch: list[dict]) -> TensorDict:
    return torch.stack([TensorDict.from_dict(item) for item in batch])


class ShareReward(Transform):
    """``("next", "reward")`` of shape ``[1, 1]`` per step (a sequence-level reward broadcast over the tokens,
    as torchrl's GSM8K reward writes it): the share of the response's characters that are in ``REWARDED``."""

    def _step(self, tensordict, next_tensordict):
        responses = tensordict.get(("text", "response"))
        texts = responses if isinstance(responses, list) else responses.tolist()
        texts = [texts] if isinstance(texts, str) else texts
        values = [vowel_share(t) for t in texts]
        next_tensordict.set("reward", torch.tensor(values, dtype=torch.float32).reshape(*next_tensordict.shape, 1, 1))
        return next_tensordict

    def transform_reward_spec(self, reward_spec):
        reward_spec["reward"] = Unbounded(reward_spec.shape + (1, 1), dtype=torch.float32)
        return reward_spec


def make_env(collector: int, prompts: int, repeats: int, tokenizer):
    from torch.utils.data import DataLoader
    from torchrl.envs.llm import ChatEnv

    loader = DataLoader(questions(prompts), batch_size=1, shuffle=False, collate_fn=_collate)
    env = ChatEnv.from_dataloader(loader, repeats=repeats, tokenizer=tokenizer, batch_size=(1,),
                                  input_mode="history", system_prompt=f"collector {collector}")
    env = env.append_transform(StepCounter(max_steps=1))
    return env.append_transform(ShareReward())


def make_policy(model, tokenizer, max_new_tokens: int = 6):
    from torchrl.modules.llm import TransformersWrapper

    return TransformersWrapper(model, tokenizer=tokenizer, input_mode="history", generate=True,
                               return_log_probs=True,
                               generate_kwargs={"max_new_tokens": max_new_tokens, "do_sample": True})


def run_collector(rb, collector: int, prompts: int, repeats: int, seed: int) -> int:
    """One collector process: every prompt ``repeats`` times, written into ``rb`` by torchrl's ``LLMCollector``;
    returns how many trajectories it produced."""
    from text_model import chat_model, chat_tokenizer
    from torchrl.collectors.llm import LLMCollector

    set_list_to_stack(True).set()
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    tokenizer = chat_tokenizer()
    env = make_env(collector, prompts, repeats, tokenizer)
    total = prompts * repeats
    collector_ = LLMCollector(env, policy=make_policy(chat_model(), tokenizer), dialog_turns_per_batch=repeats,
                              total_dialog_turns=total, replay_buffer=rb)
    for _ in collector_:
        pass
    collector_.shutdown()
    return total


def learner_actor(model, tokenizer):
    """``GRPOLoss``'s actor: the same model scoring token sequences (log-prob mode)."""
    from torchrl.modules.llm import TransformersWrapper

    return TransformersWrapper(model, tokenizer=tokenizer, input_mode="tokens", generate=False,
                               return_log_probs=True, pad_output=False)


def with_sampling_log_probs(batch, actor):
    """The batch with ``("log_probs", "full")`` of ``actor``, the policy that generated it (a copy of the
    collectors' weights: ``TransformersWrapper(generate=True)`` records the response's log-probs only, and the
    recipe gets the full ones from vLLM)."""
    with torch.no_grad():
        scored = actor(batch.select(("tokens", "full")).copy())
    for row, log_probs in zip(batch.unbind(0), scored.get(("log_probs", "full"), as_list=True), strict=True):
        row.set(("log_probs", "full"), log_probs)
    return batch


def policy_reward(model, tokenizer, prompts: int, samples: int, max_new_tokens: int = 6, seed: int = 0) -> float:
    """The mean reward of ``samples`` responses per prompt sampled from ``model`` (Hugging Face ``generate``, the
    collectors' sampling settings). Each prompt's draws are seeded: two models compared with the same seed see the
    same random numbers, so the difference measures the models, not the draws."""
    rewards = []
    for question in questions(prompts):
        chat = [{"role": "system", "content": "collector 0"}, {"role": "user", "content": question["query"]}]
        prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
        with torch.random.fork_rng(), torch.no_grad():
            torch.manual_seed(seed)
            out = model.generate(ids, do_sample=True, max_new_tokens=max_new_tokens, num_return_sequences=samples,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        rewards += [vowel_share(t) for t in tokenizer.batch_decode(out[:, ids.shape[1]:], skip_special_tokens=True)]
    return sum(rewards) / len(rewards)


def synthetic_steps(prompts: int, per_prompt: int, seed: int, collector: int = 0, per_token: bool = False):
    """``[prompts * per_prompt]`` steps in the layout ``LLMCollector`` writes (tensorclasses, a ``History`` per
    step, ragged tokens, a string ``"query"``), without running a model: for the tests that need many.
    ``per_token``: a reward per response token (``[n, 1]``) instead of one per sequence (``[1, 1]``)."""
    from tensordict import lazy_stack
    from torchrl.data.llm import History
    from torchrl.modules.llm.policies.common import ChatHistory, LogProbs, Masks, Text, Tokens

    g = torch.Generator().manual_seed(seed)
    steps = []
    for p in range(prompts):
        query = questions(prompts)[p]["query"]
        for _ in range(per_prompt):
            n_prompt, n_resp = 5 + p, int(torch.randint(1, 9, (), generator=g))
            response = "".join(chr(97 + int(i)) for i in torch.randint(0, 26, (n_resp,), generator=g))
            chat = [{"role": "system", "content": f"collector {collector}"}, {"role": "user", "content": query}]
            full = torch.randint(3, 40, (n_prompt + n_resp,), generator=g)
            step = TensorDict({
                "tokens": Tokens(prompt=full[:n_prompt], response=full[n_prompt:], full=full),
                "log_probs": LogProbs(response=-torch.rand(n_resp, generator=g)),
                "masks": Masks(all_attention_mask=torch.ones(n_prompt + n_resp, dtype=torch.bool)),
                "text": Text(prompt=f"<p>{query}", response=response, full=f"<p>{query}{response}"),
                "history": ChatHistory(prompt=History.from_chats(chat),
                                       full=History.from_chats([*chat, {"role": "assistant", "content": response}])),
                "done": torch.ones(1, dtype=torch.bool),
                "next": TensorDict({"reward": torch.rand(n_resp if per_token else 1, 1, generator=g),
                                    "done": torch.ones(1, dtype=torch.bool)}),
            })
            step.set_non_tensor("query", query)
            step.set_non_tensor(("next", "query"), query)
            steps.append(step)
    return lazy_stack(steps)


def write_steps(rb, steps, chunk: int = 3) -> int:
    """A writer process: ``steps`` handed over ``chunk`` at a time; returns how many."""
    set_list_to_stack(True).set()
    torch.set_num_threads(1)
    for start in range(0, steps.shape[0], chunk):
        rb.extend(steps[start:start + chunk])
    return steps.shape[0]


def interleaved(steps, seed: int = 1):
    """``steps`` in a seeded random order: members of different groups interleaved, as collectors hand them over."""
    order = torch.randperm(steps.shape[0], generator=torch.Generator().manual_seed(seed))
    return lazy_stack([steps[int(i)] for i in order])


def by_member(rows) -> dict:
    """``(query, response text) -> (rewards, advantages)`` of every stored row (one per sequence or per token)."""
    out = {}
    for row in rows.unbind(0):
        out[(row["query"], row["text"].response)] = (row["next", "reward"].reshape(-1).tolist(),
                                                     row["advantage"].reshape(-1).tolist())
    return out
