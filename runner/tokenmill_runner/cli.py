"""`tokenmill` command line: run, report, inspect, export (plus plan from the operator, sim-server from the
simulator)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING

from . import logs
from .generate import builtin_sim
from .generate.results import ServersUnavailable
from .generate.summary import (  # noqa: F401 - the exit codes are part of the CLI's contract (the operator uses them)
    EXIT_BROKEN_PIPE,
    EXIT_FAILED,
    EXIT_GIVEN_UP,
    EXIT_INTERRUPTED,
    EXIT_LEASE_LOST,
    EXIT_NO_SAMPLES,
    EXIT_OK,
    EXIT_SERVERS_UNAVAILABLE,
    EXIT_STATES_PENDING,
    EXIT_USAGE,
    EXIT_VERDICT,
    exit_code_table,
)
from .render.pretokenize import offline_transformers
from .report.files import NotARunOutput
from .spec.config import API_KEY_ENV, RunnerConfig, TrialSample
from .spec.resource import DatasetGeneration, SpecError, load_spec_file
from .store.lease import LeaseLost

if TYPE_CHECKING:
    from .generate.pipeline import Runner
    from .generate.summary import RunSummary

logger = logging.getLogger("tokenmill")


def _setup_logging(verbose: int) -> None:
    level = {0: logging.WARNING, 1: logging.INFO}.get(verbose, logging.DEBUG)
    logs.setup(level, "%(asctime)s %(levelname)s %(name)s: %(message)s")
    if verbose < 2:
        for noisy in ("httpx", "httpcore", "botocore", "boto3", "urllib3", "aiohttp.access"):
            logging.getLogger(noisy).setLevel(logging.WARNING)


def _add_run_parser(commands: argparse._SubParsersAction) -> None:
    run = commands.add_parser("run", help="run a DatasetGeneration on this machine (no cluster)",
                              epilog=exit_code_table(), formatter_class=argparse.RawDescriptionHelpFormatter)
    run.add_argument("spec", help="DatasetGeneration YAML file")
    run.add_argument("--server", action="append", default=[], metavar="URL", type=http_url,
                     help="SGLang base URL, http(s)://host:port (repeat for several); default: start the built-in "
                          "simulator")
    run.add_argument("--out", metavar="URI", help="output folder or s3:// prefix (default: spec.output.uri)")
    run.add_argument("--s3-endpoint", metavar="URL", type=http_url,
                     help="S3 endpoint for s3:// sources, tokenizer and output")
    run.add_argument("--name", help="name used in logs (default: metadata.name)")
    run.add_argument("--worker-index", type=int, default=int(os.environ.get("JOB_COMPLETION_INDEX", "0")),
                     help="this worker's index (default: $JOB_COMPLETION_INDEX or 0)")
    run.add_argument("--workers", type=int, default=None, help="number of workers (default: spec.runner.parallelism)")
    run.add_argument("--metrics-port", type=int, default=_env_int("TOKENMILL_METRICS_PORT"),
                     help="serve Prometheus metrics on this port (default: $TOKENMILL_METRICS_PORT, else off)")
    run.add_argument("--metrics-address", default=os.environ.get("TOKENMILL_METRICS_ADDRESS", "127.0.0.1"),
                     metavar="ADDRESS", help="address the unauthenticated metrics server binds (default: "
                     "$TOKENMILL_METRICS_ADDRESS, else 127.0.0.1: this machine only; the runner Job binds 0.0.0.0)")
    run.add_argument("--retry-failed", action="store_true",
                     help="run again the samples given up for a server-side reason (retries exhausted, bad or "
                          "corrupt responses), e.g. after a server outage; input errors stay final")
    run.add_argument("--take-over", action="store_true",
                     help="write into an output another live owner holds (its lease.json): only when that writer "
                          "is gone and you cannot wait for its lease to go stale")
    run.add_argument("--allow-unconditional-writes", action="store_true",
                     help="run on a store that ignores conditional writes (spec.output.allowUnconditionalWrites): "
                          "two runs started at the same moment could then both write the output")
    run.add_argument("--owner-uid", help=argparse.SUPPRESS)  # set by the operator: the DatasetGeneration's uid
    run.add_argument("--job-hash", help=argparse.SUPPRESS)  # set by the operator: the runner Job's hash
    run.add_argument("--states-pass", choices=("aux", "final"),
                     help="capture only this kind of hidden states, waiting for the server to serve it (the "
                          "operator's passes; default: whichever the server serves)")
    # Set by the operator's measured trial: this candidate's stratified sample is sent first (source/stratified.py).
    run.add_argument("--trial-sample", type=_trial_sample, help=argparse.SUPPRESS)
    run.add_argument("--server-wait", type=float, default=1800.0, metavar="SECONDS",
                     help="how long to wait for the servers' /health at start-up, then exit 4 (default: "
                          "%(default)g)")
    run.add_argument("--sim-time-scale", type=float, default=50.0,
                     help="built-in simulator only: simulated seconds per real second (default: %(default)g)")
    run.add_argument("--sim-max-running-requests", type=int, default=256,
                     help="built-in simulator only: continuous-batching slots (default: %(default)s)")
    run.add_argument("--sim-seed", type=int, default=0, help="built-in simulator only: output seed (default: 0)")
    run.set_defaults(handler=_cmd_run)


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


def _add_report_parser(commands: argparse._SubParsersAction) -> None:
    report = commands.add_parser(
        "report", help="the validation report of what is committed under URI",
        description="Compute the validation report from a run's commit markers, write report.json, report.md and "
                    "one PNG per dataset under URI/report/, and print the verdict. Exits 8 when the verdict is FAIL "
                    "(or WARN, with --fail-on warn), so a pipeline can gate on it; 2 when URI is no run's output.",
        epilog=exit_code_table())
    report.add_argument("uri", help="output folder or s3:// prefix of a run")
    report.add_argument("--fail-on", choices=("fail", "warn", "never"), default="fail",
                        help="the verdict that makes the command exit 8 (default: fail; warn: WARN or FAIL)")
    report.add_argument("--output", choices=("text", "json"), default="text",
                        help="text: the verdict, findings and table; json: report.json on stdout (default: text)")
    report.add_argument("--s3-endpoint", metavar="URL", type=http_url, help="S3 endpoint for S3-compatible stores")
    report.add_argument("--mix", action="store_true",
                        help="read the prompt sources run.json names: prompts repeated within and across datasets")
    report.add_argument("--eval", action="append", metavar="FILE.jsonl",
                        help="an evaluation set (JSON lines of prompts): list the prompts that share a run of "
                             "--ngram words with it (repeat; implies --mix)")
    report.add_argument("--ngram", type=int, default=13, help="words in a run that counts as overlap (default 13)")
    report.set_defaults(handler=_cmd_report)


TRUST_HELP = ("let the tokenizer's own Python code run (Kimi's tiktoken tokenizer needs it); only this flag allows "
              "it, never the run's run.json, which anyone who can write the output can edit")


def _add_inspect_parser(commands: argparse._SubParsersAction) -> None:
    inspect = commands.add_parser("inspect", help="decode committed samples into system/user/reasoning/answer/…")
    inspect.add_argument("uri", help="output folder or s3:// prefix of a run")
    inspect.add_argument("--dataset", action="append", help="dataset(s) to look in (default: all)")
    which = inspect.add_mutually_exclusive_group()
    which.add_argument("--sample", metavar="ID", help="one sample by its sample_id")
    which.add_argument("--shortest", type=int, metavar="N", help="the N shortest outputs")
    which.add_argument("--longest", type=int, metavar="N", help="the N longest outputs")
    which.add_argument("--random", type=int, metavar="N", help="N random samples (default: 1)")
    inspect.add_argument("--seed", type=int, default=0, help="seed for --random")
    inspect.add_argument("--json", action="store_true", help="exact JSON: every part's ids and full text")
    inspect.add_argument("--keep", type=int, default=120, help="tokens shown at each end of a long part")
    inspect.add_argument("--tokenizer", help="tokenizer folder (default: the one recorded in run.json)")
    inspect.add_argument("--trust-remote-code", action="store_true", help=TRUST_HELP)
    inspect.add_argument("--s3-endpoint", metavar="URL", type=http_url, help="S3 endpoint for S3-compatible stores")
    inspect.set_defaults(handler=_cmd_inspect)


def _weight(text: str) -> tuple[str, float]:
    name, _, value = text.partition("=")
    try:
        weight = float(value)
    except ValueError:
        weight = 0.0
    if not name or weight <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: write DATASET=WEIGHT with a positive weight")
    return name, int(weight) if weight.is_integer() else weight


def _add_export_parser(commands: argparse._SubParsersAction) -> None:
    from .export.formats import FORMATS
    from .export.specforge_rules import SPECFORGE_TEMPLATES

    export = commands.add_parser("export", help="committed samples as a trainer's input (SpecForge, speculators, hf)",
                                 description="Stream a run's committed samples into a trainer's input format. "
                                             "Formats and what each trainer reads: docs/export.md.",
                                 epilog=exit_code_table(), formatter_class=argparse.RawDescriptionHelpFormatter)
    export.add_argument("uri", help="output folder or s3:// prefix of a run")
    export.add_argument("dest", help="destination folder or s3:// prefix (empty, or an earlier export)")
    export.add_argument("--format", required=True, choices=list(FORMATS), help="the trainer input to write")
    export.add_argument("--dataset", action="append", help="dataset(s) to export (default: all)")
    export.add_argument("--finish-reason", choices=("stop", "length"), help="only samples that ended this way")
    export.add_argument("--exclude-truncated", action="store_true",
                        help="leave out samples cut at maxNewTokens (finish reason length)")
    export.add_argument("--per-conversation", action="store_true",
                        help="a multi-turn conversation as one record supervised on every turn, where each turn's "
                        "prompt extends the previous ids exactly (else per turn); token formats only")
    export.add_argument("--require-reasoning", action="store_true",
                        help="only samples whose output ends reasoning (the end-of-reasoning token is present)")
    export.add_argument("--exclude-findings", choices=("warn", "fail"), metavar="LEVEL",
                        help="leave out datasets the validation report flags at LEVEL (warn or fail) or worse; the "
                             "report's findings are per dataset")
    export.add_argument("--keep-mismatched", action="store_true",
                        help="text formats: write samples whose ids do not survive the round trip anyway (they stay "
                             "listed in mismatches.jsonl)")
    export.add_argument("--specforge-template", choices=sorted(SPECFORGE_TEMPLATES), metavar="NAME",
                        help="specforge-conversations: SpecForge's data.chat_template you will train with "
                             f"({', '.join(sorted(SPECFORGE_TEMPLATES))})")
    export.add_argument("--exclude-eval-overlap", action="append", metavar="FILE.jsonl",
                        help="leave out prompts sharing a run of --ngram words with this evaluation set (JSON lines "
                             "of prompts; repeat), as tokenmill report --eval finds them")
    export.add_argument("--ngram", type=int, default=13, help="words in a run that counts as overlap (default 13)")
    export.add_argument("--draft-vocab-size", type=int, action="append", metavar="N",
                        help="vocab: a draft vocabulary size to write maps for (repeat; default 32000)")
    export.add_argument("--weight", action="append", metavar="DATASET=W", type=_weight,
                        help="vocab: count DATASET W times in the mix (default 1: the run's own proportions)")
    export.add_argument("--target-vocab-size", type=int, metavar="N",
                        help="vocab: the target's vocabulary size (default: its config.json vocab_size)")
    export.add_argument("--tokenizer", help="text formats: tokenizer folder (default: the one recorded in run.json)")
    export.add_argument("--trust-remote-code", action="store_true", help=TRUST_HELP)
    export.add_argument("--overwrite", action="store_true", help="replace an earlier export in DEST")
    export.add_argument("--part-size-mb", type=int, default=256,
                        help="size of each part file (specforge, speculators, hf)")
    export.add_argument("--output", choices=("text", "json"), default="text",
                        help="text: the summary and how to load it; json: export.json on stdout (default: text)")
    export.add_argument("--s3-endpoint", metavar="URL", type=http_url, help="S3 endpoint for S3-compatible stores")
    export.add_argument("--dest-s3-endpoint", metavar="URL", type=http_url,
                        help="S3 endpoint of DEST (default: --s3-endpoint)")
    export.set_defaults(handler=_cmd_export)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="tokenmill", description=__doc__, epilog=exit_code_table(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-V", "--version", action="version", version=f"tokenmill {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=1, help="more logging (-vv for debug)")
    parser.add_argument("-q", "--quiet", action="store_const", const=0, dest="verbose", help="warnings only")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_run_parser(commands)
    _add_report_parser(commands)
    _add_inspect_parser(commands)
    _add_export_parser(commands)
    _add_plugin_parsers(commands)
    return parser


def _add_plugin_parsers(commands: argparse._SubParsersAction) -> None:
    """Subcommands other installed packages add (the operator adds `plan`, the simulator `sim-server`); the runner
    never imports them."""
    from importlib.metadata import entry_points

    for entry in entry_points(group="tokenmill.commands"):
        entry.load()(commands)
    if "sim-server" not in commands.choices:
        builtin_sim.add_missing_sim_server(commands)


def http_url(text: str) -> str:
    """An http(s) URL with a host, checked when the flag is read: `localhost:30000` would otherwise be tried (and
    waited for) for --server-wait seconds before failing."""
    from urllib.parse import urlsplit

    parts = urlsplit(text)
    if parts.scheme in ("http", "https") and parts.hostname:
        return text.rstrip("/")
    guess = text.split("://", 1)[-1]
    raise argparse.ArgumentTypeError(f"{text!r} is not an http(s) URL; did you mean http://{guess}?")


def _trial_sample(text: str) -> TrialSample:
    try:
        return TrialSample.parse(text)
    except ValueError as error:  # pydantic's errors too: argparse would print only "invalid value"
        raise argparse.ArgumentTypeError(str(error)) from None


def runner_config(resource: DatasetGeneration, args: argparse.Namespace, servers: list[str]) -> RunnerConfig:
    spec = resource.spec
    if args.s3_endpoint:
        spec = spec.model_copy(update={"output": spec.output.model_copy(update={"endpoint": args.s3_endpoint})})
    if getattr(args, "allow_unconditional_writes", False):
        spec = spec.model_copy(update={"output": spec.output.model_copy(update={"allow_unconditional_writes": True})})
    return RunnerConfig(
        spec=spec, name=args.name or resource.metadata.name, namespace=resource.metadata.namespace or "",
        servers=servers, metrics_port=args.metrics_port, metrics_address=args.metrics_address,
        retry_failed=args.retry_failed or spec.runner.retry_failed,
        output_uri=args.out or spec.output.uri, worker_index=args.worker_index,
        worker_count=args.workers or spec.runner.parallelism, server_wait_s=args.server_wait,
        owner_uid=args.owner_uid, job_hash=args.job_hash, take_over=args.take_over,
        states_pass=getattr(args, "states_pass", None), trial_sample=getattr(args, "trial_sample", None),
    )


def _start_simulator(resource: DatasetGeneration, args: argparse.Namespace, stack: ExitStack) -> str:
    from .render.pretokenize import local_model_folder

    model = resource.spec.model
    folder = local_model_folder(model.tokenizer or model.path, args.s3_endpoint or resource.spec.output.endpoint)
    url = builtin_sim.start(stack, folder, seed=args.sim_seed, time_scale=args.sim_time_scale,
                            max_running_requests=args.sim_max_running_requests,
                            trust_remote_code=model.trust_remote_code,
                            aux_hidden_states=resource.spec.hidden_states is not None,
                            aux_layer_ids=resource.spec.hidden_states.layer_ids if resource.spec.hidden_states else None)
    logger.info("no --server given: started the built-in SGLang simulator at %s (time scale %gx)",
                url, args.sim_time_scale)
    return url


async def _run_async(config: RunnerConfig) -> int:
    """Run, print the summary, and exit with a code that says how the run ended (summary.exit_code)."""
    from .generate.summary import exit_code, iter_summary_lines
    from .prepare import prepare

    runner = await prepare(config, os.environ.get(API_KEY_ENV))
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, runner.request_stop)
    # The capture pass commits after the stream: it keeps the stream's lease (it proves it at each of its markers)
    # and its client; the lease is proven once more after the last of them, and given up only then.
    with stream_settings():
        summary = await runner.run(keep_lease=True)
    try:
        for line in iter_summary_lines(summary):
            print(line)
        code = exit_code(summary)
        if code in (EXIT_INTERRUPTED, EXIT_SERVERS_UNAVAILABLE):
            return code
        if config.spec.hidden_states is not None:
            code = await _states_pass(config, runner, summary)
        # Bug 8 of the f9665d2 review: a run taken over while its last marker was in flight exited 0. Its lease is
        # proven once more after every record landed, or the run exits 6 and writes no report.
        runner.confirm_lease()
    finally:
        await runner.client.aclose()
        runner.release_lease()
    if config.worker_count == 1:  # with several workers the operator reports once all are done
        _print_report(runner.storage)
    return code


async def _states_pass(config: RunnerConfig, runner: Runner, summary: RunSummary) -> int:
    """The hidden-state pass over this worker's share, then the exit code from what the share still lacks
    (store/completion.py): a worker judges its own share, never the others'."""
    from .facts.hidden_states import NoRoomError, launch_flags
    from .generate.hidden_pass import StatesNotServed, run_hidden_state_pass
    from .generate.results import ServersUnavailable
    from .generate.summary import RETRY_HINT, exit_code, share_completion
    from .store.hidden_states import kinds_coverage

    states = config.spec.hidden_states
    assert states is not None
    try:
        captured = await run_hidden_state_pass(config, runner.storage, runner.client, os.environ.get(API_KEY_ENV),
                                               runner.fence)
    except NoRoomError as error:
        print(f"error: hidden states: {error}", file=sys.stderr)
        return EXIT_GIVEN_UP
    except StatesNotServed as error:
        print(f"error: hidden states: {error}", file=sys.stderr)
        return EXIT_SERVERS_UNAVAILABLE
    except ServersUnavailable as error:
        print(f"stopped: hidden states: {error}. Nothing was written off; run again (a restarted Job pod does) to "
              "continue once a server is up", file=sys.stderr)
        return EXIT_SERVERS_UNAVAILABLE
    print(f"hidden states ({captured.kind}): {captured.captured} captured, {captured.skipped} already committed, "
          f"{captured.failed} failed, {captured.failed_before} failed before, {captured.state_bytes} bytes")
    layouts = list(states.layouts)
    done = share_completion(summary, kinds_coverage(runner.storage, [d.name for d in config.spec.datasets], layouts,
                                                    config.share, config.states_pass))
    code = exit_code(summary, done, captured.kind)
    if done.states_failed:
        print(f"hidden states: {done.describe()}; {RETRY_HINT}", file=sys.stderr)
    pending = [kind for kind in done.pending_kinds() if kind != captured.kind]
    if code == EXIT_STATES_PENDING:
        # The operator runs each pass itself (--states-pass); a person is told what to relaunch.
        flags = " ".join(launch_flags(states.layer_ids, pending[0]))  # type: ignore[arg-type]
        print(f"hidden states: the {', '.join(pending)} states are still to capture (hiddenStates.layouts "
              f"{layouts}): restart the server with {flags} (and none of the other pass's flags) and run again",
              file=sys.stderr)
    elif code == EXIT_FAILED:
        print(f"error: this worker's share is not done: {done.describe()}; run again to continue"
              + ("" if config.generates else " (a later hidden-state pass generates nothing: run the first pass, "
                 "without --states-pass, to settle those slots)"), file=sys.stderr)
    return code


def _print_report(storage, checks=None, as_json: bool = False) -> str:
    """Write the report's files and print it; returns the verdict."""
    from .report.files import write_report
    from .report.markdown import summary

    report, written = write_report(storage, checks, recount_rows=True)
    if as_json:
        import orjson

        print(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode())
        return str(report["verdict"])
    print()
    print(summary(report))
    print("report files:")
    for uri in written:
        print(f"  {uri}")
    return str(report["verdict"])


def check_sources(resource: DatasetGeneration, endpoint: str | None) -> None:
    """Refuse a source that is not there before anything starts (the simulator, the lease, a dataset's folder):
    found later, it would stop the run halfway through its preparation and leave files behind."""
    from .source.reader import source_problem

    for index, dataset in enumerate(resource.spec.datasets):
        problem = source_problem(dataset.source, endpoint)
        if problem is not None:
            raise SpecError(f"spec.datasets[{index}].source ({dataset.name}): {problem}; fix the path (a relative "
                            "one is resolved against the spec file's folder)")


def _cmd_run(args: argparse.Namespace) -> int:
    resource = load_spec_file(args.spec)
    check_sources(resource, args.s3_endpoint or resource.spec.output.endpoint)
    with ExitStack() as stack:
        servers = args.server or [_start_simulator(resource, args, stack)]
        config = runner_config(resource, args, servers)
        with asyncio.Runner(loop_factory=_loop_factory()) as loop:
            return loop.run(_run_async(config))


# The stream allocates a few containers per answer that die young while a shard's rows wait in its buffer: at
# CPython's default gen-0 threshold (700) the cyclic collector ran every ~90 answers and traversed the buffered rows
# each time, ~40 us of CPU a sample (3-8 % of the runner's; hack/bench/profile_runner.py "garbage collection").
COLLECTOR_THRESHOLD = 20_000
TOKENIZERS_PARALLELISM = "TOKENIZERS_PARALLELISM"


@contextmanager
def stream_settings() -> Iterator[None]:
    """The process's settings while a prepared run streams, undone after it. Process-wide, so only the process that
    runs the stream uses it (`tokenmill run`, and the benchmarks of it):
    - what start-up loaded (libraries, the tokenizer, the spec) is frozen out of the cyclic collector's passes, which
      run every COLLECTOR_THRESHOLD allocations instead of 700;
    - the Rust tokenizer encodes a batch on the thread that asks (TOKENIZERS_PARALLELISM=false, unless set): its
      thread pool cost 10-35 % more CPU a prompt (a batch of 64 of the demo model's prompts, timed both ways in one
      process: 94-102 us a prompt against 103-137), and the stream keeps every core busy already (the loop, the
      commits, the batch ahead)."""
    import gc

    threshold = gc.get_threshold()
    parallelism = os.environ.get(TOKENIZERS_PARALLELISM)
    gc.freeze()
    gc.set_threshold(COLLECTOR_THRESHOLD, *threshold[1:])
    if parallelism is None:
        os.environ[TOKENIZERS_PARALLELISM] = "false"  # read by tokenizers at each batch
    try:
        yield
    finally:
        if parallelism is None:
            os.environ.pop(TOKENIZERS_PARALLELISM, None)
        gc.set_threshold(*threshold)
        gc.unfreeze()


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop where it is installed (a dependency on Linux): the runner's I/O is hundreds of keep-alive
    connections, and its loop cost ~20 % less CPU per sample than asyncio's (hack/bench/profile_runner.py)."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def _cmd_report(args: argparse.Namespace) -> int:
    from .report.files import PromptChecks, require_run_output
    from .report.validation import LEVELS
    from .store.storage import open_storage

    storage = open_storage(args.uri, args.s3_endpoint)
    require_run_output(storage)
    checks = (PromptChecks(tuple(args.eval or ()), args.ngram, args.s3_endpoint) if args.mix or args.eval
              else None)
    verdict = _print_report(storage, checks, as_json=args.output == "json")
    if args.fail_on != "never" and LEVELS.index(verdict) >= LEVELS.index(args.fail_on):
        print(f"error: the report's verdict is {verdict.upper()} (--fail-on {args.fail_on}); its findings say why",
              file=sys.stderr)
        return EXIT_VERDICT
    return EXIT_OK


def _cmd_inspect(args: argparse.Namespace) -> int:
    from .report.decode import Selection, inspect_samples
    from .store.storage import open_storage

    storage = open_storage(args.uri, args.s3_endpoint)
    selection = Selection(args.sample, args.shortest, args.longest, args.random, args.seed)
    text = inspect_samples(storage, selection, args.dataset, as_json=args.json, keep=args.keep,
                           tokenizer_folder=args.tokenizer, endpoint=args.s3_endpoint,
                           trust_remote_code=args.trust_remote_code)
    print(text)
    return EXIT_OK


def _cmd_export(args: argparse.Namespace) -> int:
    from .export.exporter import ExportRequest, export
    from .export.filters import ExportFilters
    from .export.manifest import summary_lines

    filters = ExportFilters(datasets=tuple(args.dataset) if args.dataset else None, finish_reason=args.finish_reason,
                            exclude_truncated=args.exclude_truncated, require_reasoning=args.require_reasoning,
                            exclude_findings=args.exclude_findings,
                            eval_files=tuple(args.exclude_eval_overlap or ()), ngram=args.ngram)
    request = ExportRequest(args.uri, args.dest, args.format, filters, keep_mismatched=args.keep_mismatched,
                            overwrite=args.overwrite, tokenizer=args.tokenizer,
                            trust_remote_code=args.trust_remote_code,
                            specforge_template=args.specforge_template, part_bytes=args.part_size_mb * 1024 * 1024,
                            s3_endpoint=args.s3_endpoint, dest_s3_endpoint=args.dest_s3_endpoint,
                            per_conversation=args.per_conversation,
                            draft_vocab_sizes=tuple(args.draft_vocab_size or (32000,)),
                            weights=tuple(args.weight or ()), target_vocab_size=args.target_vocab_size)
    manifest = export(request)
    offline = manifest["format"] in ("specforge-offline", "speculators-offline")
    if manifest["format"] == "vocab":
        from .export.vocab import summary_lines as vocab_lines

        lines, count = vocab_lines(manifest), len(manifest["files"])
    elif offline:
        from .export.offline import incomplete, written
        from .export.offline import summary_lines as offline_lines

        lines, count = offline_lines(manifest), written(manifest)
    else:
        lines, count = list(summary_lines(manifest)), manifest["counts"]["written"]
    if args.output == "json":
        import orjson

        print(orjson.dumps(manifest, option=orjson.OPT_INDENT_2).decode())
    else:
        for line in lines:
            print(line)
    if not count:
        print(f"error: nothing exported to {args.dest}: no record was written (the lines above say why: filters, "
              "excluded datasets, refused units); only export.json records the attempt", file=sys.stderr)
        return EXIT_NO_SAMPLES
    if offline and incomplete(manifest):
        return EXIT_GIVEN_UP  # features missing never look like success
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(args.verbose)
    offline_transformers()
    try:
        return args.handler(args)
    except (SpecError, NotARunOutput) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except ServersUnavailable as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_SERVERS_UNAVAILABLE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`tokenmill plan ... | head`): end as a command killed by SIGPIPE does, quietly;
        # stdout goes to /dev/null so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except LeaseLost as error:
        print(f"error: lease lost: {error}. This run committed nothing after that (a write already under way "
              "counts for nobody: the run that took over sealed this one's commits); what it committed before "
              "counts. Rerun once the other writer is done (or gone)", file=sys.stderr)
        return EXIT_LEASE_LOST
    except Exception as error:  # the CLI's last line of defence: one clear line, details at debug level
        logger.debug("failure", exc_info=True)
        print(f"error: {type(error).__name__}: {error}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
