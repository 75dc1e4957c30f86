"""Job instances from Slurm: the parsers on each release's real sacct output (tests/golden) and on
squeue's -O text, and the commands CliSlurm runs for a batch of ids."""
import pytest

from policy_service.slurm.slurm import CliSlurm, JobInstance, SlurmError
from policy_service.slurm.slurm_text import (SQUEUE_TIME_ENV, _clock_time, instance_key, parse_sacct_instances,
                                             parse_squeue_instances, squeue_instance_format)
from policy_service.core.dialect import dialect_for, parse_release
from tests.slurm_cli_fake import GOLDEN, RELEASES, RecordingCli, sacct_text, squeue_line

# What each release's golden sacct.json holds (tests/golden/<release>/sacct.json): job 22 a
# cancelled whole-GPU job with no AdminComment, job 23 a cancelled shard job with one (after the
# held jobs of contrib/matrix/golden.sh).
GOLDEN_TIMES = {  # release -> (submit, start, end) of both jobs
    "22.05": (1796385895, 1796385898, 1796385898),
    "24.11": (1796386018, 1796386020, 1796386021),
    "26.05": (1796386043, 1796386046, 1796386046),
}


@pytest.mark.parametrize("release", RELEASES)
def test_sacct_instances_of_every_release(release):
    found = parse_sacct_instances((GOLDEN / release / "sacct.json").read_text())
    submit, start, end = GOLDEN_TIMES[release]
    assert [(i.job_id, i.cluster, i.submit_time, i.start_time, i.end_time, i.state, i.source) for i in found] == [
        (22, "swapaware-dev", submit, start, end, "CANCELLED", "sacct"),
        (23, "swapaware-dev", submit, start, end, "CANCELLED", "sacct")]
    assert found[0].admin_comment == ""  # 22.05: null; 24.11+: ""
    assert found[1].admin_comment == "swapaware:v1 id=golden action=share shards=2"
    assert found[1].key == f"swapaware-dev/23/{submit}" and found[1].sluid == ""


@pytest.mark.parametrize("release", RELEASES)
def test_sacct_instances_of_a_reused_id_are_all_kept(release):
    old = JobInstance(1, "c", 1000, 1010, 1100, "swapaware:v1 id=A", "COMPLETED")
    new = JobInstance(1, "c", 5000, 5001, 0, "swapaware:v1 id=B", "RUNNING")
    found = parse_sacct_instances(sacct_text(release, [old, new]))
    assert [(i.key, i.start_time, i.end_time, i.admin_comment, i.state) for i in found] == [
        ("c/1/1000", 1010, 1100, "swapaware:v1 id=A", "COMPLETED"), ("c/1/5000", 5001, 0, "swapaware:v1 id=B", "RUNNING")]


def test_sacct_instances_refuse_garbage():
    with pytest.raises(SlurmError):
        parse_sacct_instances("sacct: error: Problem talking to the database")


def test_squeue_instance_format_asks_sluid_only_where_the_release_has_it():
    assert squeue_instance_format(False) == "JobId:|,Cluster:|,SubmitTime:|,StartTime:|,EndTime:|,State:|,admin_comment:"
    assert squeue_instance_format(True).endswith(",State:|,SLUID:|,admin_comment:")
    assert [dialect_for(parse_release(r)).has_sluid for r in RELEASES] == [False, False, True]


@pytest.mark.parametrize("with_sluid", [False, True])
def test_squeue_instances_parse(with_sluid):
    rows = [JobInstance(10, "swapaware-dev", 1796284609, 1796284611, 0, "swapaware:v1 id=d1 action=share why=a|b",
                        "RUNNING", "sAK5M8XEFWTR00" if with_sluid else "", "squeue"),
            JobInstance(12, "swapaware-dev", 1796284700, 1796284701, 1796284760, "", "COMPLETED", "", "squeue"),
            JobInstance(13, "swapaware-dev", 1796284800, 1796284801, 1796284900, "", "COMPLETING", "", "squeue")]
    text = "".join(squeue_line(r, with_sluid) + "\n" for r in rows)
    text += "14|swapaware-dev|1796284900|1796285000|1796288600|PENDING|(null)\n".replace(
        "PENDING|", "PENDING|N/A|" if with_sluid else "PENDING|")
    found = parse_squeue_instances(text, with_sluid)
    assert found[:3] == rows
    # a pending job's start and end are expected ones, not real
    assert (found[3].job_id, found[3].start_time, found[3].end_time, found[3].admin_comment) == (14, 0, 0, "")


def test_squeue_instances_running_job_end_is_not_real():
    (inst,) = parse_squeue_instances("7|c|100|110|1000|RUNNING|x\n", False)
    assert inst.end_time == 0 and inst.start_time == 110


@pytest.mark.parametrize("line", ["JOBID|CLUSTER|SUBMIT_TIME", "12_3|c|1|2|3|RUNNING|x", "7|c|1|2"])
def test_squeue_instances_refuse_what_is_not_a_row(line):
    with pytest.raises(SlurmError):
        parse_squeue_instances(line + "\n", False)


def test_squeue_times_epoch_or_local_iso():
    import time

    assert _clock_time("1796284609") == 1796284609
    assert _clock_time("2026-12-03T07:56:49") == int(time.mktime((2026, 12, 3, 7, 56, 49, 0, 0, -1)))
    assert [_clock_time(t) for t in ("N/A", "Unknown", "None", "NONE", "")] == [0] * 5


@pytest.mark.parametrize("release", RELEASES)
def test_cli_reads_many_ids_in_one_squeue_and_one_sacct(release):
    live = [JobInstance(j, "c", 100 + j, 200 + j, 0, f"swapaware:v1 id=d{j}", "RUNNING",
                        f"s{j:012d}" if release == "26.05" else "", "squeue") for j in (3, 5)]
    ended = [JobInstance(j, "c", 100 + j, 200 + j, 300 + j, f"swapaware:v1 id=d{j}", "COMPLETED", "", "sacct")
             for j in (4, 6)]
    cli = RecordingCli(release, live=live, accounting=ended)
    assert cli.live_instances([5, 3, 4, 3]) == live
    assert cli.ended_instances([6, 4]) == ended
    (squeue, env), (sacct, _) = cli.calls
    assert squeue[:7] == ["squeue", "-h", "-a", "-t", "all", "-j", "3,4,5"]
    assert squeue[8] == squeue_instance_format(release == "26.05") and env == SQUEUE_TIME_ENV
    assert sacct == ["sacct", dialect_for(parse_release(release)).sacct_json_arg, "-X", "-D", "--allusers", "-j",
                     "4,6"]
    assert cli.live_instances([]) == [] and len(cli.calls) == 2  # nothing asked: no command


def test_single_gone_id_is_an_empty_answer_not_an_error():
    class Gone(CliSlurm):
        def _run(self, argv, env_extra=None):
            raise SlurmError("squeue -h ... exited 1: slurm_load_jobs error: Invalid job id specified")

    assert Gone().live_instances([9]) == []
    with pytest.raises(SlurmError):
        Gone().ended_instances([9])


def test_instance_key():
    assert instance_key("swapaware-dev", 1, 1796284609) == "swapaware-dev/1/1796284609"
