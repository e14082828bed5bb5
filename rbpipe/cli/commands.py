"""``rbpipe`` command line: argument parsing and presentation only; the work lives in the library.

Size (over 500 lines): one parser and one presentation function per subcommand (``run``, ``serve``, ``collector``,
``learner``, ``inspect``, ``query``, ``view``, ``stress``, ...); the work itself lives in the library.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from rbpipe.errors import ConfigError, RbpipeError

DESCRIPTION = """\
rbpipe: shared, persistent GRPO replay buffers on torchrl.

Collector processes sample a tiny language model, a shared MCAdvantage transform groups their
trajectories across processes and computes group-relative advantages, whole groups are committed to an
on-disk store (Arrow by default), and a learner process trains on them with torchrl's GRPO loss.
"""

EPILOG = """\
examples:
  rbpipe run                                  # 2 collectors + learner, new store under ./runs/
  rbpipe run --collectors 4 --loss dapo --steps 400
  rbpipe run --resume runs/20261202-120000-ab12cd
  rbpipe run --task examples/custom_task.py:NextDigitTask --steps 100
  rbpipe run --model path/to/hf_model_dir --task my_tasks.py:MyTask
  rbpipe run --model DIR --task rbpipe.demo.arithmetic:AdditionTask --max-new-tokens 16
  rbpipe run --model DIR --prompts data.jsonl --prompt-key question --reward rewards.py:exact_match
  rbpipe serve --run-dir runs/shared --steps 200   # then, from other shells:
  rbpipe collector --connect runs/shared           #   (as many as you like, any time)
  rbpipe learner --connect runs/shared
  rbpipe inspect runs/<run>/store --limit 5
  rbpipe inspect STORE --json --where "list_avg(returns) > 0.5"
  rbpipe query STORE "select policy_version, avg(next_reward) from trajectories group by 1 order by 1"
  rbpipe stress --writers 4 --trajectories 4000 --kill-rate 0.001
  rbpipe export STORE --zarr archive.zarr
  rbpipe view runs/<run>                      # the stored groups in the browser, live: http://127.0.0.1:8765/
  rbpipe view runs/<run> --html rollouts.html # the same page as one self-contained file
"""


#: what ``--resume`` may change: everything else comes from the saved run (a clear error otherwise)
RESUME_OVERRIDES = {"steps", "resume", "no_progress", "json", "listen", "engine", "ray_address", "grouping_shards",
                    "ray_num_cpus", "ray_resources", "ray_num_gpus"}
RAY_OPTIONS = ("ray_address", "grouping_shards", "ray_num_cpus", "ray_resources", "ray_num_gpus")
_UNSET = object()


def _add_run(sub, command: str = "run") -> argparse.ArgumentParser:
    if command == "run":
        p = sub.add_parser(
            "run", help="run the whole pipeline: collectors, shared grouping, store, learner",
            description="Spawn collector processes and a learner around one shared MCAdvantage replay buffer "
                        "persisted to disk, train until --steps, then print a summary and write a reward plot. "
                        "The same as `rbpipe serve` plus collectors and a learner attached to it.",
            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    else:
        p = sub.add_parser(
            "serve", help="start the shared state only; collectors and a learner attach with --connect",
            description="Start a run's shared state (grouping manager, store, weights, rate limit) without any "
                        "worker and write RUN_DIR/endpoint.json plus its key (RUN_DIR/authkey, owner-only). Attach "
                        "workers from any shell: `rbpipe collector --connect RUN_DIR`, `rbpipe learner --connect "
                        "RUN_DIR`. Runs until SIGINT/SIGTERM or until the attached learner has done --steps, then "
                        "writes summary.json as `rbpipe run` does.",
            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("processes and storage")
    g.add_argument("--collectors", type=int, default=2,
                   help="collector processes" if command == "run" else
                   "collectors a prompt's samples are shared among (each work unit is one collector's share)")
    if command == "serve":
        g.add_argument("--listen", metavar="HOST:PORT",
                       help="listen on TCP (loopback or a host address; port 0 picks a free port) so that workers "
                            "on other hosts attach with --connect HOST:PORT and RBPIPE_AUTHKEY; default: a "
                            "private Unix socket")
    g.add_argument("--store", type=Path, help="store directory (default: RUN_DIR/store)")
    g.add_argument("--run-dir", type=Path, help="run directory (default: a new folder under ./runs/)")
    g.add_argument("--resume", type=Path, metavar="RUN_DIR",
                   help="continue a stopped or crashed run with its saved configuration (only --steps may change)")
    g.add_argument("--backend", choices=["arrow", "zarr"], default="arrow", help="storage backend")
    g = p.add_argument_group("engine (where the processes run)")
    g.add_argument("--engine", choices=["local", "ray"], default="local",
                   help="local: multiprocess workers on this machine; ray: the grouping shards, the coordinator, "
                        "the collectors and the learner as Ray actors (pip install -e '.[ray]'; docs/RAY.md)")
    g.add_argument("--ray-address", metavar="ADDR",
                   help="join this Ray cluster (e.g. HEAD_IP:6379); default: a private Ray instance on loopback, "
                        "shut down at the end")
    g.add_argument("--grouping-shards", type=int, metavar="K",
                   help="--engine ray: registry shard actors; group ids are partitioned by a stable hash (default 1)")
    g.add_argument("--ray-num-cpus", type=float, metavar="N", help="--engine ray: CPUs per worker actor (default 1)")
    g.add_argument("--ray-resources", metavar="JSON",
                   help="--engine ray: custom resources per worker, e.g. '{\"collectors\": [{\"node_b\": 0.01}, "
                        "{\"node_c\": 0.01}], \"learner\": {\"head\": 0.01}}' (collector i takes entry i mod len)")
    g = p.add_argument_group("grouping (torchrl MCAdvantage options)")
    g.add_argument("--grpo-size", type=int, default=8, help="trajectories per group")
    g.add_argument("--trajectory-return", choices=["sum", "max", "mean", "none"], default="sum",
                   help="reduce each trajectory's rewards to a return ('none': per-step normalisation)")
    g.add_argument("--keep-return-bounds", type=float, nargs=2, metavar=("LOW", "HIGH"),
                   help="dynamic sampling: drop groups whose mean return is outside (LOW, HIGH)")
    g.add_argument("--candidate-group-size", type=int, help="oversample this many candidates per group")
    g.add_argument("--selector", choices=["first", "uniform", "balanced"], default="balanced",
                   help="how to pick grpo_size trajectories among the candidates")
    g = p.add_argument_group("task and model")
    g.add_argument("--task", metavar="SPEC",
                   help="task to train on: path/to/file.py:Name or package.module:Name, an object (or a class or "
                        "factory returning one) with prompt(index) -> a 1-D LongTensor of token ids, a str or chat "
                        "messages, and reward(prompt, response) -> float (response: the token ids, or the decoded "
                        "text for a text prompt); None: the built-in rbpipe.demo.task:CopyFirstDigitTask")
    g.add_argument("--model", type=Path, metavar="PATH",
                   help="local Hugging Face causal-LM directory (save_pretrained output with its tokenizer) that "
                        "collectors sample and the learner trains; never downloads; None: the built-in tiny Qwen2")
    _add_device_options(p)
    g = p.add_argument_group("rollouts and learner")
    g.add_argument("--steps", type=int,
                   help="learner steps: the cap of a run that stops at --target-reward (default 600), or exactly this "
                        "many steps when --target-reward is not given (with --resume: the saved run's)")
    g.add_argument("--target-reward", type=_target, metavar="R|none",
                   help="stop once the mean reward of the last 10 learner steps is at least R (default 0.9 when "
                        "--steps is not given; 'none' runs every step)")
    g.add_argument("--groups-per-step", type=int, default=8, help="whole groups per learner step")
    g.add_argument("--lr", type=float, default=1e-3, help="learning rate (0 = a control run that cannot learn)")
    g.add_argument("--temperature", type=float, default=1.0, help="collectors' sampling temperature")
    g.add_argument("--max-new-tokens", type=int, default=1,
                   help="the cap on a response's length (responses end earlier at EOS or a --stop string), also the "
                        "constant seq-mean-token-sum-norm divides by")
    g.add_argument("--max-policy-lag", type=int, default=4,
                   help="skip groups sampled by a policy more than this many versions old")
    g.add_argument("--max-lead-groups", type=int,
                   help="how many prompts collectors may run ahead of the prompts the pipeline is done with "
                        "(trained on, skipped as stale, or dropped) "
                        "(default: groups-per-step x 2, x 1 when --max-policy-lag < 3: the next step's groups are "
                        "generated while this one trains, so the learner trains on groups one version old)")
    g.add_argument("--samples-per-insert", type=float, default=1.0,
                   help="rate limiter: groups the learner resolves per group collectors insert, in (0, 1]; "
                        "below 1 collectors may out-produce the learner (the surplus turns stale)")
    g.add_argument("--min-groups-to-sample", type=int,
                   help="rate limiter: fresh groups the learner waits for before a step (default: groups-per-step)")
    g.add_argument("--one-version-per-group", action=argparse.BooleanOptionalAction,
                   default=False,
                   help="one collector generates a prompt's whole group with one weights version (off: a "
                        "prompt's samples are split among the collectors)")
    g.add_argument("--sample-order", choices=["oldest", "freshest"], default="oldest",
                   help="which complete groups the learner trains first: in commit order, or those of the newest "
                        "policy version (the rest turn stale past --max-policy-lag, counted)")
    g.add_argument("--micro-batches", type=int, default=1, help="gradient-accumulation micro-batches per step")
    g.add_argument("--checkpoint-every", type=int, default=10, metavar="N",
                   help="learner steps between checkpoints (RUN_DIR/checkpoint.pt): where --resume and a learner "
                        "actor restarted by Ray continue from")
    g.add_argument("--seed", type=int, default=0)
    _add_text_options(p)
    g = p.add_argument_group("loss")
    g.add_argument("--loss", choices=["grpo", "dapo", "cispo"], default="grpo", help="policy objective")
    g.add_argument("--loss-agg-mode", default="token-mean",
                   choices=["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
    g.add_argument("--kl-type", default="k3", choices=["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"])
    g.add_argument("--kl-coef", type=float, default=0.0, help="KL-to-reference coefficient (0 = off)")
    g.add_argument("--rollout-is", choices=["token", "sequence", "geometric", "none"],
                   help="rollout importance sampling level: weights each token by the learner's over the collector's "
                        "probability, correcting for the policy lag of a pipeline's groups (default token; none = "
                        "off; mismatch metrics always logged)")
    g.add_argument("--rollout-is-mode", choices=["truncate", "mask", "both"], default="truncate")
    g.add_argument("--rollout-is-threshold", type=float, nargs=2, metavar=("LOWER", "UPPER"),
                   help="IS weight bounds (LOWER < UPPER)")
    g.add_argument("--rollout-is-veto", type=float, nargs=2, metavar=("LOWER", "UPPER"),
                   help="mask a whole sequence if any token weight is outside these bounds")
    g.add_argument("--logger", choices=["csv", "tensorboard", "wandb", "mlflow"], default="csv",
                   help="torchrl logger for the learner's per-step metrics, under RUN_DIR/logs (wandb and "
                        "mlflow offline: no network); metrics.jsonl is always written")
    g.add_argument("--no-progress", action="store_true", help="no live progress bar")
    g.add_argument("--json", action="store_true",
                   help="print the summary as one JSON object on stdout (table and progress go to stderr)")
    return p


def _add_device_options(p: argparse.ArgumentParser) -> None:
    """Where the model runs and in what precision (``rbpipe.model.device``)."""
    g = p.add_argument_group("devices and precision")
    g.add_argument("--device", default="cpu", metavar="cpu|cuda|cuda:N",
                   help="where the learner and the collectors run the model")
    g.add_argument("--collector-device", metavar="DEV",
                   help="where the collectors sample, if not --device (e.g. the learner on cuda:0, collectors on "
                        "cuda:1)")
    g.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="collectors' weights and the learner's compute (autocast); the learner keeps float32 "
                        "master weights and float32 log-probs and ratios")
    g.add_argument("--ray-num-gpus", type=float, metavar="N",
                   help="--engine ray: GPUs per worker actor (default 0; e.g. 1 with --device cuda)")


def _device_options(args) -> dict:
    return {"device": args.device, "collector_device": args.collector_device, "dtype": args.dtype}


def _add_text_options(p: argparse.ArgumentParser) -> None:
    """Text tasks, prompts from a data file and generation that stops (issue 38)."""
    g = p.add_argument_group("text tasks and generation")
    g.add_argument("--prompts", metavar="FILE",
                   help="prompts from a .jsonl or .parquet data file instead of --task (with --prompt-key, --reward)")
    g.add_argument("--prompt-key", metavar="COL", help="--prompts: the column holding each row's prompt (a str or "
                                                       "chat messages [{'role': ..., 'content': ...}])")
    g.add_argument("--reward", metavar="SPEC",
                   help="--prompts: reward function (file.py:fn or module:fn), called as fn(prompt, response, **row) "
                        "with the decoded response and the row's other columns")
    g.add_argument("--no-chat-template", action="store_true",
                   help="send text prompts as they are instead of through the tokenizer's chat template")
    g.add_argument("--stop", action="append", metavar="STR", default=None,
                   help="end a response once its text contains STR (repeatable); responses always end at the "
                        "tokenizer's / generation config's EOS token(s), --max-new-tokens being the cap")
    g.add_argument("--top-k", type=int, metavar="K", help="sample among the K most likely tokens (None: all)")
    g.add_argument("--top-p", type=float, metavar="P", help="nucleus sampling: the smallest set of tokens of "
                                                            "probability >= P (None: all)")
    g.add_argument("--reward-timeout", type=float, default=30.0, metavar="S",
                   help="seconds one reward call may take; a reward that raises or runs past it drops that sample "
                        "(counted by reason in the summary's rejected_reasons) and the run goes on")


def _target(text: str) -> float | None:
    if text.lower() in ("none", "off"):
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a reward (e.g. 0.9) or none, got {text!r}") from None


def _add_worker(sub, kind: str) -> None:
    what = ("generate the prompts the service hands out and hand the samples over" if kind == "collector"
            else "train on the store's fresh groups and publish the weights (one learner per service)")
    p = sub.add_parser(kind, help=f"attach a {kind} to a running `rbpipe serve`",
                       description=f"Attach a {kind} to a running service: {what}. It stops when the service asks "
                                   "(its learner is done, or it is stopped), on Ctrl-C, or when the service is gone.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--connect", required=True, metavar="RUN_DIR|HOST:PORT",
                   help="the service's run directory (reads endpoint.json and the key there), or HOST:PORT of a "
                        "service started with --listen (key from RBPIPE_AUTHKEY or --authkey-file)")
    p.add_argument("--authkey-file", help="file holding the service's key (hex), e.g. a copy of RUN_DIR/authkey")
    p.add_argument("--task", metavar="SPEC", help="must be the service's task (checked; default: the service's)")
    p.add_argument("--model", metavar="PATH", help="must be the service's model (checked; default: the service's)")
    if kind == "collector":
        p.add_argument("--collector-id", type=int, help="id written with this collector's samples "
                                                        "(default: the next free one)")


def _add_inspect(sub) -> None:
    p = sub.add_parser("inspect", help="list the groups stored in a store (reads only; never blocks writers)",
                       description="Summarise a store and list its latest committed groups from the "
                                   "Parquet catalogue (pyarrow). Never needs the writer lock.")
    p.add_argument("store", type=Path, help="store directory")
    p.add_argument("--json", action="store_true", help='print {"groups": [...], ...} as JSON')
    p.add_argument("--group", help="show only this group id")
    p.add_argument("--where", help='DuckDB SQL condition over the groups view, e.g. "list_avg(returns) > 0.5" '
                                   'or "group_id = 3" (rbpipe query --help lists the columns)')
    p.add_argument("--limit", type=int, default=20, help="latest N groups (0 = all)")
    p.add_argument("--texts", action="store_true",
                   help="also show each group's texts: the prompt, then every member's reward, finish_reason and "
                        "response (text tasks store them; token-level tasks show their finish reasons)")


QUERY_EXAMPLES = """\
examples:
  rbpipe query STORE "select count(*) from trajectories"
  rbpipe query STORE "select policy_version, avg(next_reward), count(*) from trajectories group by 1 order by 1"
  rbpipe query STORE "select group_id, returns, advantages from groups where list_avg(returns) > 0.5" --json
"""


def _add_query(sub) -> None:
    from rbpipe.cli.tables import VIEWS_HELP

    p = sub.add_parser("query", help="run SQL (DuckDB) over a store's groups and trajectories",
                       description="Run one DuckDB SQL statement over two views of a store, built from its files "
                                   "(reads only; never blocks writers; no torch).",
                       epilog=VIEWS_HELP + "\n" + QUERY_EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("store", type=Path, help="store directory (e.g. runs/<run>/store)")
    p.add_argument("sql", help="one SQL statement over the views groups and trajectories")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true",
                     help='print {"columns": [...], "rows": [{...}]} as one JSON document')
    fmt.add_argument("--csv", action="store_true", help="print CSV with a header line (lists as JSON arrays)")


def _add_stress(sub) -> None:
    p = sub.add_parser("stress", help="hammer the shared grouping with writer processes and verify the store",
                       description="W writer processes push N trajectories with random group interleavings "
                                   "and rewards (optionally killing writers), then verify from the store: "
                                   "nothing lost or duplicated, groups whole, advantages exact.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--writers", type=int, default=4, help="writer processes (spawned)")
    p.add_argument("--trajectories", type=int, default=2000, help="trajectories pushed in total")
    p.add_argument("--group-size", type=int, help="grpo_size (random per run when omitted)")
    p.add_argument("--payload", choices=["16x64", "tok1024", "small"], default="small",
                   help="per trajectory: 16 steps x 64 floats, one 1,024-token sequence, or a few scalars")
    p.add_argument("--interleave", choices=["random", "round-robin", "grouped"], default="random",
                   help="how a group's members are spread over writers and time")
    p.add_argument("--kill-rate", type=float, default=0.0, help="probability per trajectory of SIGKILLing a writer")
    p.add_argument("--dynamic-sampling", action="store_true", help="drop all-0/all-1 groups")
    p.add_argument("--grouping", choices=["rbpipe", "torchrl", "both"], default="rbpipe",
                   help="rbpipe's shared MCAdvantage, torchrl's stock one (the baseline), or both in turn")
    p.add_argument("--seed", type=int, default=0, help="seeds group ids, rewards, interleaving and kills")
    p.add_argument("--store", type=Path, help="keep the store here (otherwise a temporary directory)")
    p.add_argument("--json", action="store_true", help="print one JSON object per run instead of a table")


def _add_export(sub) -> None:
    p = sub.add_parser("export", help="export a store's committed groups to another format",
                       description="Copy every committed group of STORE into a Zarr store (chunk = one group).")
    p.add_argument("store", type=Path)
    p.add_argument("--zarr", type=Path, required=True, metavar="OUT",
                   help="output Zarr store directory (must not exist yet)")


VIEW_PORT = 8765


def _add_view(sub) -> None:
    p = sub.add_parser("view", help="see a store's groups in the browser, live while a run writes, or as one HTML file",
                       description="Serve a local web page of a store's groups (group id, prompt, policy version, "
                                   "mean reward, size), each opened to its members, with SQL filters over the "
                                   "views of `rbpipe query` and a plot of reward and advantage per policy version. "
                                   "It refreshes while a run writes and never takes the writer lock. With --html, "
                                   "write the same page as one self-contained file (no server, no network).",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("path", type=Path, metavar="PATH", help="a store (runs/<run>/store) or a run directory (runs/<run>)")
    p.add_argument("--port", type=int, default=VIEW_PORT, help="port to listen on (0: a free one; the URL is printed)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on; the loopback default shows the page to this machine only")
    p.add_argument("--html", type=Path, metavar="OUT.html",
                   help="write the page with its data to this file instead of serving it")
    p.add_argument("--where", metavar="CONDITION",
                   help="filter: a DuckDB condition over the groups view, e.g. \"list_avg(returns) > 0.5\" (the "
                        "live page starts with it; the --html file holds only the groups it selects)")
    p.add_argument("--limit", type=int, help="--html: the newest N groups (default 10000; 0 = all)")


class RbpipeParser(argparse.ArgumentParser):
    """The top-level parser; keeps its ``run`` and ``serve`` subparsers (``explicit_options`` reads them)."""

    run_parser: argparse.ArgumentParser
    serve_parser: argparse.ArgumentParser


def build_parser() -> RbpipeParser:
    parser = RbpipeParser(prog="rbpipe", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parser.run_parser = _add_run(sub)
    parser.serve_parser = _add_run(sub, "serve")
    _add_worker(sub, "collector")
    _add_worker(sub, "learner")
    _add_inspect(sub)
    _add_query(sub)
    _add_stress(sub)
    _add_export(sub)
    _add_view(sub)
    return parser


def explicit_options(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The ``dest`` of every option given on the command line (not left at its default)."""
    ns = argparse.Namespace(**{a.dest: _UNSET for a in parser._actions if a.dest != "help"})
    parser.parse_known_args(argv, ns)
    return {k for k, v in vars(ns).items() if v is not _UNSET}


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _check_run_options(given: set[str], resume: bool, rollout_is_off: bool) -> None:
    """Options that would be silently ignored are errors."""
    if resume:
        ignored = sorted(given - RESUME_OVERRIDES)
        if ignored:
            raise ConfigError(f"--resume continues a run with its saved configuration, so {_flag(ignored[0])} "
                              "would be ignored: drop it (only --steps may change on resume), or start a new run "
                              "with a new --run-dir")
    for dest in ("rollout_is_mode", "rollout_is_threshold", "rollout_is_veto"):
        if dest in given and rollout_is_off:
            raise ConfigError(f"{_flag(dest)} applies only with --rollout-is token|sequence|geometric: drop "
                              f"--rollout-is none or {_flag(dest)}")


def run_config(args, given: set[str]):
    """The :class:`~rbpipe.config.RunConfig` of ``rbpipe run``/``serve`` arguments (``given``: the options on the
    command line, see :func:`explicit_options`)."""
    from rbpipe.config import DEFAULT_LOSS, RunConfig

    rollout_is = args.rollout_is or DEFAULT_LOSS["rollout_is"]
    loss = {"loss": args.loss, "loss_agg_mode": args.loss_agg_mode, "kl_type": args.kl_type,
            "kl_coef": args.kl_coef, "rollout_is": None if rollout_is == "none" else rollout_is,
            "rollout_is_mode": args.rollout_is_mode}
    if args.rollout_is_threshold:
        loss["rollout_is_threshold"] = tuple(args.rollout_is_threshold)
    if args.rollout_is_veto:
        loss["rollout_is_veto"] = tuple(args.rollout_is_veto)
    return RunConfig(
        collectors=args.collectors, backend=args.backend, grpo_size=args.grpo_size,
        trajectory_return=None if args.trajectory_return == "none" else args.trajectory_return,
        keep_return_bounds=tuple(args.keep_return_bounds) if args.keep_return_bounds else None,
        candidate_group_size=args.candidate_group_size, selector=args.selector,
        steps=args.steps if args.steps is not None else RunConfig.steps,
        # --steps alone runs that many steps; without it the run stops at the target (600 steps at most)
        target_reward=(args.target_reward if "target_reward" in given
                       else None if args.steps is not None else RunConfig.target_reward),
        groups_per_step=args.groups_per_step, lr=args.lr, temperature=args.temperature,
        max_new_tokens=args.max_new_tokens, max_policy_lag=args.max_policy_lag,
        max_lead_groups=args.max_lead_groups, samples_per_insert=args.samples_per_insert,
        min_groups_to_sample=args.min_groups_to_sample,
        one_version_per_group=args.one_version_per_group, sample_order=args.sample_order,
        micro_batches=args.micro_batches, checkpoint_every=args.checkpoint_every, seed=args.seed, loss=loss,
        logger=args.logger,
        prompts=args.prompts, prompt_key=args.prompt_key, reward=args.reward, chat_template=not args.no_chat_template,
        stop=list(args.stop or []), top_k=args.top_k, top_p=args.top_p, reward_timeout=args.reward_timeout,
        **({"task": args.task} if args.task is not None else {}),
        model=str(args.model) if args.model is not None else None,
        **_device_options(args))


def _run(args, given: set[str]) -> int:
    serving = args.command == "serve"
    if not args.no_progress:  # importing torch and spawning the workers takes seconds before the progress line
        print(f"rbpipe {args.command}: starting " + ("the service" if serving else "processes"), file=sys.stderr,
              flush=True)
    if args.engine == "local":  # the workers' fork server imports torch & co. on the other core meanwhile
        from rbpipe.system.procs import warm_worker_server

        warm_worker_server()
    from rbpipe.service.endpoint import parse_listen
    from rbpipe.workers.launcher import launch, serve

    _check_run_options(given, args.resume is not None, args.rollout_is == "none")
    cfg = run_config(args, given)
    cfg.loss_config()  # validate before any process starts
    with _stdout_for_json(args.json) as out:
        log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else print
        start = (functools.partial(serve, listen=parse_listen(args.listen)) if serving else launch)
        ray_given = {d: getattr(args, d) for d in RAY_OPTIONS if getattr(args, d) is not None}
        if ray_given and args.engine != "ray":
            raise ConfigError(f"{_flag(next(iter(ray_given)))} applies only with --engine ray")
        if args.ray_num_gpus is not None and args.ray_num_gpus < 0:
            raise ConfigError(f"--ray-num-gpus must be >= 0, got {args.ray_num_gpus}")
        if args.grouping_shards is not None and args.grouping_shards < 1:
            raise ConfigError(f"--grouping-shards must be >= 1, got {args.grouping_shards}")
        if args.engine == "ray":
            from rbpipe.service.ray import parse_resources  # Ray itself is imported only when the run starts

            args.ray_resources = parse_resources(args.ray_resources)  # before anything is written
            start = functools.partial(start, engine="ray", ray={
                "address": args.ray_address, "grouping_shards": args.grouping_shards or 1,
                "num_cpus": args.ray_num_cpus if args.ray_num_cpus is not None else 1,
                "num_gpus": args.ray_num_gpus or 0, "resources": args.ray_resources})
        if args.resume is not None:  # the saved configuration wins; only --steps may extend the run
            summary = start(None, resume=args.resume, steps=args.steps, progress=not args.no_progress, log=log)
        else:
            summary = start(cfg, run_dir=args.run_dir, store=args.store, progress=not args.no_progress, log=log)
        if out is not None:
            out.write(json.dumps(summary, default=str) + "\n")
            out.flush()
    return 0 if summary["status"] in ("done", "stopped") else 1


def exit_quietly_on_ctrl_c() -> None:
    """``rbpipe run``/``serve`` is over (workers stopped, summary printed): a Ctrl-C from now on (the second of
    a double Ctrl-C, say) ends the process at once, instead of a traceback from whichever interpreter-exit step
    it lands in (torch's atexit hooks)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    signal.signal(signal.SIGINT, lambda *_: os._exit(130))


def _worker(args) -> int:
    """``rbpipe collector|learner --connect``: the same loop ``rbpipe run`` spawns, attached from here."""
    import signal

    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    kw = dict(authkey_file=args.authkey_file, task=args.task, model=args.model,
              log=lambda *a: print(*a, flush=True))
    if args.command == "collector":
        from rbpipe.workers.collector import run_collector

        stopped_by = run_collector(args.connect, args.collector_id, **kw)
    else:
        from rbpipe.workers.learner import run_learner

        stopped_by = run_learner(args.connect, **kw)
    if stopped_by:  # it took the signal where that was safe and left the service cleanly; 130 as before
        print(f"rbpipe {args.command}: interrupted ({stopped_by}); it left the service cleanly", flush=True)
        return 130
    print(f"rbpipe {args.command}: done (the service asked its workers to stop)", flush=True)
    return 0


@contextlib.contextmanager
def _stdout_for_json(enabled: bool) -> Iterator:
    """With ``--json``, stdout must carry the JSON object alone: yield a handle on the real stdout while
    file descriptor 1 (inherited by every worker process) and ``sys.stdout`` point at stderr."""
    if not enabled:
        yield None
        return
    sys.stdout.flush()
    try:
        fd = sys.stdout.fileno()
        err_fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (e.g. captured by a test): Python level only
        real = sys.stdout
        sys.stdout = sys.stderr
        try:
            yield real
        finally:
            sys.stdout = real
        return
    saved = os.dup(fd)
    os.dup2(err_fd, fd)
    real = os.fdopen(os.dup(saved), "w")
    try:
        yield real
    finally:
        sys.stdout.flush()
        real.close()
        os.dup2(saved, fd)
        os.close(saved)


def _inspect(args) -> int:
    from rbpipe.storage import inspect_store

    limit = None if args.limit == 0 else args.limit
    info = inspect_store(args.store, where=args.where, group=args.group, limit=limit)
    if args.group is not None and not info["groups"]:
        print(f"rbpipe inspect: no group {args.group} in {args.store} ({info['groups_committed']} groups "
              "committed; list them with `rbpipe inspect STORE --limit 0`)", file=sys.stderr)
        return 1
    texts = _group_texts(args.store, info["groups"]) if args.texts else None
    if args.json:
        if texts is not None:
            for g in info["groups"]:
                g["texts"] = texts.get(g["seq"], [])
        print(json.dumps(info, default=str))
        return 0
    print(f"store {info['store']}  backend={info['backend']}  format v{info['format_version']}  "
          f"groups={info['groups_committed']}  rows={info['rows']}")
    tail = info.get("torn_tail") or {}
    if any(v for v in tail.values() if isinstance(v, (int, float))) \
            or any(isinstance(v, dict) and v for v in tail.values()):
        print(f"note: uncommitted bytes were ignored (never served): {tail}")
    from rbpipe.cli.tables import format_groups

    print(format_groups(info["groups"]))
    if texts is not None:
        from rbpipe.cli.tables import format_texts

        for g in info["groups"]:
            print()
            print(format_texts(g, texts.get(g["seq"], [])))
    return 0


def _group_texts(store: Path, groups: list[dict]) -> dict[int, list[dict]]:
    """``{seq: [member rows]}`` of ``groups`` from the ``trajectories`` view: the columns of
    :data:`rbpipe.cli.tables.TEXT_COLUMNS` that the store has."""
    from rbpipe.cli.tables import TEXT_COLUMNS
    from rbpipe.storage.query import query

    seqs = sorted({int(g["seq"]) for g in groups})
    if not seqs:
        return {}
    have = set(query(store, "select * from trajectories limit 0").column_names)
    cols = ", ".join(["seq"] + [c for c in TEXT_COLUMNS if c in have])
    rows = query(store, f"select {cols} from trajectories where seq in ({', '.join(map(str, seqs))}) "
                        "order by seq, member").to_pylist()
    out: dict[int, list[dict]] = {}
    for row in rows:
        out.setdefault(int(row["seq"]), []).append(row)
    return out


def _query(args) -> int:
    from rbpipe.cli.tables import query_text
    from rbpipe.storage.query import query, to_csv, to_json

    table = query(args.store, args.sql)
    print(to_json(table) if args.json else to_csv(table).rstrip("\n") if args.csv else query_text(table))
    return 0


def _stress(args) -> int:
    from rbpipe.cli.stress import check_stress_args, format_stress_table, run_stress

    check_stress_args(writers=args.writers, trajectories=args.trajectories, group_size=args.group_size,
                      kill_rate=args.kill_rate)
    impls = ["rbpipe", "torchrl"] if args.grouping == "both" else [args.grouping]
    results = []
    for impl in impls:
        results.append(run_stress(writers=args.writers, trajectories=args.trajectories,
                                  group_size=args.group_size, payload=args.payload, interleave=args.interleave,
                                  kill_rate=args.kill_rate, seed=args.seed, grouping=impl,
                                  store=args.store if impl == impls[0] else None,
                                  dynamic_sampling=args.dynamic_sampling))
    if args.json:
        print(json.dumps(results[0] if len(results) == 1 else {"results": results}, default=str))
    else:
        for r in results:
            print(format_stress_table(r))
    return 0 if all(r.get("ok") for r in results) else 1


def _export(args) -> int:
    from rbpipe.storage import export_zarr

    if args.zarr.exists() and (not args.zarr.is_dir() or any(args.zarr.iterdir())):
        raise ConfigError(f"--zarr {args.zarr} already exists: exporting again would add a second copy of every "
                          "group; pass a new output directory (or delete it first)")
    n = export_zarr(args.store, args.zarr)
    print(f"exported {n} groups from {args.store} to {args.zarr}")
    return 0


def _view(args) -> int:
    """``rbpipe view``: everything is checked (store, filter, output or port) before the page is served or
    the file written; nothing is ever written to the store."""
    import signal
    from urllib.parse import quote

    from rbpipe.view.html import DEFAULT_LIMIT, check_output, write_html
    from rbpipe.view.source import StoreView, resolve_store

    if args.html is None and args.limit is not None:
        raise ConfigError("--limit applies only with --html (the live page is paged): drop it or add --html OUT.html")
    if args.limit is not None and args.limit < 0:
        raise ConfigError(f"--limit must be >= 0 (0 = all groups), got {args.limit}")
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in 0..65535 (0 picks a free port), got {args.port}")
    store, run_dir = resolve_store(args.path)
    if args.html is not None:
        check_output(args.html, store)
    view = StoreView(store, run_dir)
    try:
        view.page(args.where, 0, 1)  # a filter that does not parse is refused here, in one line
        if args.html is not None:
            done = write_html(view, args.html, args.where, DEFAULT_LIMIT if args.limit is None else args.limit)
            print(f"rbpipe view: wrote {done['path']} ({done['groups']} of {done['total']} groups, "
                  f"{done['bytes'] / 1e6:.1f} MB); open it in a browser, no server needed")
            return 0
        from rbpipe.view.server import ViewServer

        server = ViewServer((args.host, args.port), view)
        signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
        url = server.url + (f"?where={quote(args.where)}" if args.where else "")
        print(f"rbpipe view: serving {store} at {url} (Ctrl-C stops)", flush=True)
        try:
            server.serve_forever(poll_interval=0.2)
        except KeyboardInterrupt:
            for sig in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C or kill while closing changes nothing
                signal.signal(sig, signal.SIG_IGN)
            print("rbpipe view: stopped", flush=True)
        finally:
            server.server_close()
        return 0
    finally:
        view.close()


def main(argv: list[str] | None = None) -> int:
    as_program = argv is None  # the `rbpipe` command itself (a caller passing argv keeps its own signal handlers)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    handlers = {"inspect": _inspect, "query": _query, "stress": _stress, "export": _export, "view": _view,
                "collector": _worker, "learner": _worker}
    try:
        if args.command in ("run", "serve"):
            argv = sys.argv[1:] if argv is None else argv
            sub_parser = parser.run_parser if args.command == "run" else parser.serve_parser
            try:
                return _run(args, explicit_options(sub_parser, argv[argv.index(args.command) + 1:]))
            finally:
                if as_program:
                    exit_quietly_on_ctrl_c()
        return handlers[args.command](args)
    except RbpipeError as err:
        print(f"rbpipe {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"rbpipe {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `rbpipe inspect STORE | head`: the reader had enough; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 0


if __name__ == "__main__":
    sys.exit(main())
