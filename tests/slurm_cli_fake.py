"""A stateful stand-in for squeue and sacct behind the real ``CliSlurm`` (its argv building and its
parsers run; only the subprocess is replaced). squeue answers in the text ``squeue -O`` prints
(SLURM_TIME_FORMAT=%s), sacct in JSON made from the release's golden ``sacct.json`` (captured from
real daemons), so the parsing path is the one each release's output takes. Every command is
recorded: tests count Slurm queries."""
from __future__ import annotations

import copy
import json
from pathlib import Path

from policy_service.slurm.slurm import CliSlurm, JobInstance
from policy_service.core.dialect import dialect_for, parse_release

GOLDEN = Path(__file__).resolve().parent / "golden"
RELEASES = ("22.05", "24.11", "26.05")


def golden_sacct(release: str) -> dict:
    return json.loads((GOLDEN / release / "sacct.json").read_text())


def _squeue_time(t: int) -> str:
    return str(t) if t > 0 else "N/A"


def squeue_line(inst: JobInstance, with_sluid: bool) -> str:
    """One line of ``squeue -h -O squeue_instance_format(with_sluid)`` (width 0: fields as they are;
    squeue prints "(null)" for an unset AdminComment, "NONE" for the end of a job without limit)."""
    end = _squeue_time(inst.end_time) if inst.end_time else "NONE"
    cols = [str(inst.job_id), inst.cluster, _squeue_time(inst.submit_time), _squeue_time(inst.start_time), end,
            inst.state]
    if with_sluid:
        cols.append(inst.sluid or "N/A")
    return "|".join(cols) + "|" + (inst.admin_comment or "(null)")


def sacct_text(release: str, instances: list[JobInstance]) -> str:
    """``sacct --json`` of this release for these instances (the golden record, its fields set)."""
    data = golden_sacct(release)
    template = data["jobs"][1]
    numbers = isinstance(template["priority"], int)  # 22.05: plain numbers; 24.11+: {set, infinite, number}
    jobs = []
    for inst in instances:
        j = copy.deepcopy(template)
        j["job_id"] = inst.job_id
        j["cluster"] = inst.cluster
        j["comment"]["administrator"] = inst.admin_comment or (None if numbers else "")
        j["time"].update(submission=inst.submit_time, start=inst.start_time, end=inst.end_time)
        state = inst.state or ("COMPLETED" if inst.end_time else "RUNNING")
        j["state"]["current"] = state if numbers else [state]
        jobs.append(j)
    data["jobs"] = jobs
    return json.dumps(data)


class RecordingCli(CliSlurm):
    """``CliSlurm`` of a release whose squeue shows ``live`` and whose sacct shows ``accounting``."""

    def __init__(self, release: str, live: list[JobInstance] | None = None,
                 accounting: list[JobInstance] | None = None):
        super().__init__(dialect=dialect_for(parse_release(release)))
        self.release = release
        self.live = list(live or [])
        self.accounting = list(accounting or [])
        self.calls: list[tuple[list[str], dict | None]] = []
        self.fail: str = ""  # set: every command fails with this stderr

    @property
    def commands(self) -> list[str]:
        return [argv[0] for argv, _ in self.calls]

    def _run(self, argv: list[str], env_extra: dict[str, str] | None = None) -> str:
        from policy_service.slurm.slurm import SlurmError

        self.calls.append((list(argv), env_extra))
        if self.fail:
            raise SlurmError(f"{' '.join(argv)} exited 1: {self.fail}")
        ids = {int(j) for j in argv[argv.index("-j") + 1].split(",")}
        if argv[0] == "squeue":
            sluid = self.dialect.has_sluid
            return "".join(squeue_line(i, sluid) + "\n" for i in self.live if i.job_id in ids)
        if argv[0] == "sacct":
            return sacct_text(self.release, [i for i in self.accounting if i.job_id in ids])
        raise AssertionError(f"unexpected command {argv}")
