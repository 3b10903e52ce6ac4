"""The DatasetGeneration status as pydantic models (the CRD's status schema is generated from them)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from tokenmill_runner.spec.resource import SpecModel

from .planner import ServerPlan

CONDITION_TYPES = ("ServerReady", "Progressing", "Stalled", "Succeeded", "Failed", "Ready", "PlanVerified",
                   "ReplanSuggested", "Replanned", "Trialled")
Phase = Literal["Pending", "Queued", "StartingServer", "Generating", "Reporting", "Succeeded", "Failed",
                "Suspended"]


class Condition(SpecModel):
    """metav1.Condition."""

    type: str = Field(description="Condition type: ServerReady, Progressing, Stalled, Succeeded, Failed, Ready, "
                                  "PlanVerified, ReplanSuggested or Replanned.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(description="One-word CamelCase reason.")
    message: str = Field("", description="What a person should know, and what to do.")
    last_transition_time: str = Field(description="When the status last changed (RFC 3339).")
    observed_generation: int = Field(0, description="The .metadata.generation this condition was computed for.")


class Progress(SpecModel):
    completed: int = Field(0, description="Samples committed with a generated output.")
    failed: int = Field(0, description="Samples recorded as failed (see the errors/ folder of each dataset).")
    total: int = Field(0, description="Samples to process (rows of the sources, after limits).")
    generated_tokens: int = Field(0, description="Output tokens committed.")
    truncated: int = Field(0, description="Committed samples that hit maxNewTokens (finish_reason length).")
    tokens_per_second: int = Field(0, description="Committed output tokens per second, recent window.")
    samples_per_second: str = Field("0", description="Committed samples per second, recent window (decimal).")
    eta_seconds: int | None = Field(None, description="Estimated seconds until every sample is committed: the "
                                    "output tokens left (each dataset's committed mean once it has 32 samples, the "
                                    "plan's before) at the run's recent output tokens/s.")
    eta: str = Field("", description="ETA as HH:MM:SS, for kubectl.")
    display: str = Field("", description="completed+failed/total (percent), for kubectl.")
    given_up: int = Field(0, description="Failed samples given up for a server-side reason (retries exhausted, bad "
                                         "answers): run them again with the tokenmill.io/retry-failed annotation.")
    failed_by_reason: dict[str, int] = Field(default_factory=dict,
                                             description="Failed samples by reason (the errors/ records' reason).")


class DatasetProgress(Progress):
    name: str = Field(description="Dataset name.")
    eta_seconds: int | None = Field(None, description="Seconds this dataset's remaining samples take at the run's "
                                    "recent output tokens/s (datasets run one after another: the run's ETA is their "
                                    "sum).")


class ReportStatus(SpecModel):
    uri: str = Field(description="Where report.json, report.md and the plots are.")
    verdict: Literal["pass", "warn", "fail"] = Field(description="The report's verdict.")
    findings: list[str] = Field(default_factory=list, description="The report's warnings and failures.")


class RunStatus(SpecModel):
    """What the run was started with. model.path, model.tokenizer and output.uri cannot change once this is set."""

    model_path: str = Field(max_length=2048, description="spec.model.path the run started with.")
    tokenizer: str = Field(max_length=2048, description="The tokenizer the run started with (spec.model.tokenizer, "
                                                        "or the model path).")
    output_uri: str = Field(max_length=2048, description="spec.output.uri the run started with.")
    job_hash: str = Field("", max_length=64, description="Hash of everything the runner Job depends on; when it "
                                                         "changes the operator replaces the Job.")


class RetryStatus(SpecModel):
    handled: str = Field(max_length=253, description="The last tokenmill.io/retry-failed annotation value handled.")
    at: str = Field(description="When it was handled (RFC 3339).")
    outcome: str = Field("", description="What the operator did with it.")
    token: str = Field("", max_length=253, description="The last value that restarted the runner with --retry-failed "
                                                       "(part of the runner Job's hash).")


class StartupStatus(SpecModel):
    """The weights' copy and load: predicted by the plan, and as observed on a server pod."""

    predicted_copy_seconds: int | None = Field(None, description="The plan's copy of the weights.")
    predicted_load_seconds: int | None = Field(None, description="The plan's load (CUDA graphs, warmup included).")
    observed_copy_seconds: int | None = Field(None, description="The copy as it ran (the copying init container, "
                                                                "or the shared cache's fill Job).")
    observed_load_seconds: int | None = Field(None, description="From SGLang's start until the pod was Ready.")


class VerificationStatus(SpecModel):
    """The plan checked on the GPUs: its batch and decode step beside what SGLang reported over the verification
    window (spec.server.verifyWindowSeconds after the server first ran requests; docs/planning.md)."""

    verified: bool = Field(description="Both within the tolerance (PlanVerified True); False: PlanOff.")
    predicted_batch: int = Field(description="Requests one replica runs at once, as planned.")
    observed_batch: int = Field(description="Median running requests of a replica over the window's steady part.")
    predicted_step_milliseconds: str = Field(description="The plan's decode step at its batch (decimal).")
    observed_step_milliseconds: str = Field(
        description="Median running / gen_throughput over the window's steady part (decimal).")
    samples: int = Field(description="Scrapes of /metrics with running requests in the window.")
    retractions: int = Field(0, description="Requests SGLang retracted in the window (its KV cache ran out).")
    queued: int = Field(0, description="Median requests waiting in a replica's queue over the window.")
    window_seconds: int = Field(description="How long the window lasted.")
    at: str = Field(description="When the check was made (RFC 3339).")
    planned_generation: int = Field(0, description="The plan checked: the .metadata.generation it was made for.")
    layout: str = Field("", description="The layout checked when the operator switched it (status.layoutOverride, "
                        "replan auto or a trial's winner); empty: the spec's plan. A switched layout is checked again.")

    def covers(self, planned_generation: int, layout: str) -> bool:
        return self.planned_generation == planned_generation and self.layout == layout


class LayoutOverride(SpecModel):
    """The layout the operator switched the server to (spec.server.replan auto): serverPlan is made for it instead
    of the spec's choice, for this one spec generation. An edit of the spec (a new generation) plans from the spec
    again and clears it; the operator switches at most once per generation."""

    generation: int = Field(description="The .metadata.generation it applies to (status.plannedGeneration).")
    replicas: int = Field(description="Server replicas of the chosen layout.")
    tensor_parallel: int = Field(description="GPUs per replica of the chosen layout.")
    attention_data_parallel: int = Field(1, description="DP attention groups per replica (1 = off).")
    kv_cache_dtype: str = Field("auto", description="--kv-cache-dtype (always the running one's: never changed).")
    from_layout: str = Field(description="The layout it replaced, e.g. 2 x TP 4.")
    to_layout: str = Field(description="The layout switched to, e.g. 8 x TP 1.")
    reason: str = Field(description="Why, with the figures (the Replanned condition's message).")
    current_eta_seconds: int = Field(description="Remaining generation on the replaced layout (measured constants).")
    new_eta_seconds: int = Field(description="Remaining generation on the chosen layout (measured constants).")
    gain_seconds: int = Field(description="current - new: what the switch is predicted to save before the restart.")
    restart_seconds: int = Field(description="The restart it pays: the plan's start-up (copy, load, warm-up).")
    margin_seconds: int = Field(description="The margin the gain had to beat on top of the restart.")
    at: str = Field(description="When the operator switched (RFC 3339).")

    @property
    def token(self) -> str:
        """What the runner Job's hash includes: a new switch is a new Job (its workers read the servers' new count
        and sizes at start)."""
        return (f"{self.generation}:{self.replicas}x{self.tensor_parallel}x{self.attention_data_parallel}:"
                f"{self.kv_cache_dtype}")


class TrialCandidate(SpecModel):
    """One layout of the measured trial (spec.server.trial auto) and what was measured on it."""

    layout: str = Field(description="The layout, e.g. 1 x TP 8 + DP attention 4.")
    replicas: int = Field(description="Server replicas.")
    tensor_parallel: int = Field(description="GPUs per replica.")
    attention_data_parallel: int = Field(1, description="DP attention groups per replica (1 = off).")
    kv_cache_dtype: str = Field("auto", description="--kv-cache-dtype.")
    predicted_eta_seconds: int = Field(0, description="The plan's ETA for the whole job on this layout.")
    state: Literal["Pending", "Measuring", "Measured"] = Field("Pending", description="Where its measurement is.")
    tokens_per_second: float | None = Field(None, description="Measured steady output tokens/s (the server's "
                                          "gen_throughput summed over its replicas).")
    tokens_per_second_low: float | None = Field(None, description="Low end of its 99 % interval.")
    tokens_per_second_high: float | None = Field(None, description="High end of its 99 % interval.")
    measured_seconds: int | None = Field(None, description="How long it was measured (from its first scrape).")
    stop: str | None = Field(None, description="Why its measurement ended: ranked (told apart from the others), "
                             "precise (the first one, within 2 %) or budget (its time spent; flagged).")
    flagged: bool = Field(False, description="Stopped on its budget without being told apart from the others.")
    message: str = Field("", description="Its steady-state detection's latest word while measured.")

    @property
    def key(self) -> tuple[int, int, int, str]:
        return self.replicas, self.tensor_parallel, self.attention_data_parallel, self.kv_cache_dtype


class TrialStatus(SpecModel):
    """The measured trial (spec.server.trial auto): the candidates in order, the one measured now, and the result.
    The operator's only memory of it: a restarted operator resumes from here (the candidate being measured is
    measured again from its next scrape)."""

    generation: int = Field(description="The planned generation it is for (status.plannedGeneration).")
    phase: Literal["Measuring", "Done", "Skipped"] = Field(description="Measuring, Done (a winner), or Skipped "
                                                           "(no trial pays for this job; see reason).")
    candidates: list[TrialCandidate] = Field(default_factory=list, description="In the order they are measured, "
                                             "the plan's pick first.")
    current: int = Field(0, description="Index of the candidate being measured (while Measuring).")
    measure_seconds: int = Field(0, description="Each candidate's time budget (trial.select).")
    restart_seconds: int = Field(0, description="One restart in another layout (the plan's start-up model).")
    budget_seconds: int = Field(0, description="What the trial may spend: 5 % of the predicted ETA.")
    sample_prompts: int = Field(0, description="Rows each candidate's runner Job sends first: its own stratified "
                                "sample of every dataset (0: none, the job's own next rows).")
    sample_output_tokens: dict[str, int] = Field(default_factory=dict, description="The plan's mean output "
                                                 "tokens per dataset, each dataset's weight in the samples.")
    winner: str | None = Field(None, description="The measured fastest.")
    continued_on: str | None = Field(None, description="The layout the run continues on (the winner, unless "
                                     "switching to it does not pay its restart).")
    reason: str = Field("", description="Why the trial was skipped, or how it concluded, with the figures.")


class StatesPass(SpecModel):
    """Which hidden-state pass the server and the runner Job are on, for layouts that need two (SpecForge's: the
    aux layers, then the final state from a server relaunched without aux capture; facts/hidden_states.py). The
    operator's only memory of it: kept for one planned generation and retry, so a spec edit or a retry that may
    generate new samples starts again from the first pass, which captures only what is missing."""

    kind: Literal["aux", "final"] = Field(description="The kind of states being captured now.")
    run: str = Field(description="The planned generation and retry token it is for (generation:retry).")
    since: str = Field(description="When this pass started (RFC 3339).")


class QueueStatus(SpecModel):
    """Where the run stands in Kueue (set when the resource has the kueue.x-k8s.io/queue-name label)."""

    name: str = Field(description="The LocalQueue (the kueue.x-k8s.io/queue-name label).")
    workload: str = Field(description="The Kueue Workload that stands for the whole run (server and runner pods).")
    admitted: bool = Field(False, description="Kueue admitted the Workload: the run may hold its GPUs.")
    position: int | None = Field(None, description="Place among the LocalQueue's workloads waiting for quota "
                                                   "(1 is next), while not admitted.")
    cluster_queue: str | None = Field(None, description="The ClusterQueue that admitted it.")
    message: str = Field("", description="What Kueue says about it.")


class DatasetGenerationStatus(SpecModel):
    observed_generation: int = Field(0, description="The .metadata.generation the status reflects.")
    phase: Phase = Field("Pending", description="Display-only summary of the conditions.")
    message: str = Field("", description="What is happening now, or what went wrong and what to do.")
    conditions: list[Condition] = Field(default_factory=list, description="metav1.Condition list.")
    server_plan: ServerPlan | None = Field(None, description="The server plan in use, with its arithmetic.")
    progress: Progress = Field(default_factory=Progress, description="Progress over all datasets.")
    datasets: list[DatasetProgress] = Field(default_factory=list, description="Progress per dataset.")
    report: ReportStatus | None = Field(None, description="The validation report, once written.")
    start_time: str | None = Field(None, description="When generation started.")
    completion_time: str | None = Field(None, description="When the run succeeded or failed.")
    last_commit_time: str | None = Field(None, description="Time of the newest commit marker.")
    run: RunStatus | None = Field(None, description="What the run was started with (set with the first runner Job).")
    retry: RetryStatus | None = Field(None, description="The last retry request handled.")
    queue: QueueStatus | None = Field(None, description="Kueue admission, when the run is queued through Kueue.")
    startup: StartupStatus | None = Field(None, description="The weights' copy and load, predicted and observed.")
    verification: VerificationStatus | None = Field(
        None, description="The plan's batch and step beside SGLang's, once the verification window closed.")
    planned_generation: int = Field(0, description="The .metadata.generation serverPlan was computed for.")
    layout_override: LayoutOverride | None = Field(
        None, description="The layout the operator switched to after measuring the plan (spec.server.replan auto); "
        "serverPlan is made for it. Cleared by a spec edit.")
    trial: TrialStatus | None = Field(
        None, description="The measured trial of the plan's closest layouts (spec.server.trial auto).")
    states_pass: StatesPass | None = Field(
        None, description="The hidden-state pass in progress, for spec.hiddenStates.layouts that need two.")
    observation_failed_since: str | None = Field(
        None, description="Since when storage or the API server cannot be read (unset once they can).")
    server_starting_since: str | None = Field(
        None, description="Since when the server is being started for a run with no runner yet (unset once it is "
        "ready): the start deadline and the stall window count from here.")


def merge_patch(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """The JSON merge patch (RFC 7386) that turns `old` into `new`: keys gone from `new` become null (a merge patch
    keeps every key it does not mention), nested objects are patched key by key, everything else is replaced."""
    patch: dict[str, Any] = {key: None for key in old if key not in new}
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, dict) and isinstance(before, dict):
            nested = merge_patch(before, value)
            if nested:
                patch[key] = nested
        elif value != before:
            patch[key] = value
    return patch
