"""The runner's configuration: the spec plus what this process is (servers, worker index, output)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..facts.hidden_states import kinds_needed
from ..store.work_split import WorkShare
from .resource import MAX_TOKENS, DatasetGenerationSpec

API_KEY_ENV = "TOKENMILL_API_KEY"
# The most rows one trial candidate is sent first (held tokenized until sent: ~80 MB at 1,000 tokens a prompt).
MAX_TRIAL_PROMPTS = 20_000
TRIAL_SAMPLE_BYTES = 64 * 1024  # --trial-sample's JSON, bounded before it is parsed


class TrialSample(BaseModel):
    """One candidate's share of the operator's measured trial (--trial-sample, set by the operator): the rows of
    its stratified sample are sent first (source/stratified.py). The same seed, count, rows and output lengths in
    every Job of one trial give the candidates disjoint samples."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    seed: str = Field(min_length=1, max_length=64, description="The trial's seed (its planned generation).")
    candidate: int = Field(ge=0, description="This Job's candidate, counted from 0.")
    candidates: int = Field(ge=1, le=16, description="The trial's candidates.")
    prompts: int = Field(ge=1, le=MAX_TRIAL_PROMPTS, description="Rows of each candidate's sample.")
    # Finite and at most MAX_TOKENS: NaN, Infinity and 1e308 passed and crashed the runner later
    # (security-f9665d2.md W7).
    output_tokens: dict[str, Annotated[float, Field(ge=0, le=MAX_TOKENS, allow_inf_nan=False)]] = Field(
        default_factory=dict, alias="outputTokens", max_length=1024,
        description="The plan's mean output tokens per dataset: each dataset's weight in the sample.")

    @model_validator(mode="after")
    def _candidate_in_range(self) -> TrialSample:
        if self.candidate >= self.candidates:
            raise ValueError(f"candidate {self.candidate} must be below the candidate count {self.candidates}")
        return self

    @classmethod
    def parse(cls, text: str) -> TrialSample:
        size = len(text.encode())
        if size > TRIAL_SAMPLE_BYTES:
            raise ValueError(f"--trial-sample: {size:,} bytes, over the {TRIAL_SAMPLE_BYTES:,} allowed")
        return cls.model_validate_json(text)

    def token(self) -> str:
        """What the runner Job's hash and command line carry."""
        return self.model_dump_json(by_alias=True)


class RunnerConfig(BaseModel):
    """Everything one runner process needs. Secrets (the server API key) come from the environment only."""

    model_config = ConfigDict(extra="forbid")

    spec: DatasetGenerationSpec
    name: str = Field("local", description="DatasetGeneration name, for logs and metrics labels.")
    namespace: str = Field("", description="DatasetGeneration namespace, for metrics labels.")
    metrics_port: int | None = Field(None, gt=0, lt=65536, description="Serve Prometheus metrics on this port.")
    metrics_address: str = Field("127.0.0.1", description="Address the metrics server binds.")
    servers: list[str] = Field(min_length=1, description="SGLang base URLs.")
    output_uri: str
    worker_index: int = Field(0, ge=0)
    worker_count: int = Field(1, ge=1)
    retry_failed: bool = Field(False, description="Run again the samples whose last attempt ran out of retries.")
    server_wait_s: float = Field(1800.0, gt=0, description="How long to wait for the servers to become healthy.")
    progress_log_s: float = Field(10.0, gt=0, description="Progress log interval when stderr is not a terminal.")
    probe_first_s: float = Field(1.0, gt=0, description="First /health probe of a replica taken out of rotation.")
    probe_max_s: float = Field(30.0, gt=0, description="Longest interval between /health probes of a replica.")
    owner_uid: str | None = Field(None, description="The DatasetGeneration's uid when a runner Job runs this: the "
                                  "resource owns the output (its Jobs share the output lease).")
    job_hash: str | None = Field(None, description="The hash of the runner Job this process belongs to, recorded "
                                 "in run.json (the operator compares it with the Job's); default: the spec's hash.")
    take_over: bool = Field(False, description="Take the output's lease from another live owner.")
    states_pass: Literal["aux", "final"] | None = Field(
        None, description="The hidden states this run captures (the operator's pass: it waits for the server to "
        "serve that kind); default: whichever the server serves.")
    trial_sample: TrialSample | None = Field(
        None, description="The operator's measured trial: this candidate's sample is sent first.")

    @model_validator(mode="after")
    def _index_in_range(self) -> RunnerConfig:
        if self.worker_index >= self.worker_count:
            raise ValueError(f"worker index {self.worker_index} must be below the worker count {self.worker_count}")
        return self

    @property
    def share(self) -> WorkShare:
        """This worker's share of every pass (store/work_split.py)."""
        return WorkShare(self.worker_index, self.worker_count)

    @property
    def generates(self) -> bool:
        """Whether this process generates: not in a hidden-state pass after the first (the final-state pass of
        SpecForge's layout). Such a pass runs against a server relaunched for another kind of states, and a sample
        it generated would never get the first pass's states; what is still unsettled is the first pass's work."""
        states = self.spec.hidden_states
        if self.states_pass is None or states is None:
            return True
        return self.states_pass == kinds_needed(list(states.layouts))[0]

    @property
    def retry_failed_slots(self) -> bool:
        """--retry-failed for the slots (given-up samples are generated again): only where this process
        generates. The captures' failures are retried by `retry_failed` in every pass."""
        return self.retry_failed and self.generates
