"""core/admission.py: the table key, the table reference in AdminComments, gate states (from
policy.py's own queue predicates) and the entries' decisions."""
import dataclasses

import pytest

from policy_service._generated.swapaware.v1 import policy_pb2 as pb
from policy_service.config import Config, PolicyConfig
from policy_service.core import admission, policy, queue_rules
from policy_service.core.types import (ClassStats, GpuRequest, GresKind, JobRequest, KeyLevel, QueueState,
                                       ReasonCode, Rewrite, UserFigure)

V = "0123456789abcdef"


def cfg(**policy_kw) -> Config:
    return Config(policy=dataclasses.replace(PolicyConfig(), **policy_kw))


def test_the_key_renders_every_field_decide_reads_in_order():
    job = pb.JobFacts(user="alice", uid=1000, account="proj", partition="gpu", job_name="train",
                      tres_per_node="gres/gpu:1", time_limit_min=60, script_fingerprint="00000001deadbeef",
                      work_dir="/home/alice", comment="c", env_mem_hint="4G", min_nodes=1, num_tasks=1,
                      is_batch=True, het_job=False, qos="high", ntasks_per_tres=0, tres_bind="", exclusive="")
    fields = admission.table_key(job).split(admission.SEP)
    assert len(fields) == len(admission.KEY_FIELDS) == 22
    assert fields == ["alice", "proj", "gpu", "train", "gres/gpu:1", "", "", "", "00000001deadbeef", "c", "4G",
                      "1", "1", "1", "0", "high", "", "", "0", "", "", ""]
    # uid, work_dir and the time limit are not read by decide(): not in the key
    assert admission.table_key(job) == admission.table_key(pb.JobFacts(**{
        **{f.name: getattr(job, f.name) for f in job.DESCRIPTOR.fields
           if f.name not in ("uid", "work_dir", "time_limit_min")}}))


def test_is_batch_unset_counts_as_batch_and_each_field_changes_the_key():
    a = pb.JobFacts(user="u")
    assert admission.table_key(a).split(admission.SEP)[13] == "1"
    assert admission.table_key(pb.JobFacts(user="u", is_batch=False)).split(admission.SEP)[13] == "0"
    keys = set()
    for name, kind in admission.KEY_FIELDS:
        job = pb.JobFacts(user="u", is_batch=True)
        setattr(job, name, {"s": "x", "i": 7, "b": name != "is_batch"}[kind])
        keys.add(admission.table_key(job))
    assert len(keys) == len(admission.KEY_FIELDS)


def test_a_separator_inside_a_field_is_never_published():
    assert admission.publishable(pb.JobFacts(user="u", comment="a b"))
    assert not admission.publishable(pb.JobFacts(user="u", comment="a\x1fb"))
    assert not admission.publishable(pb.JobFacts(user="u", job_name="\x1f"))


def test_the_table_reference_survives_the_comment_cut_or_is_refused():
    comment = f"swapaware:v1 id={admission.PLACEHOLDER_ID} model=m action=share shards=2 why=fits_in_shards"
    ref = admission.TableRef(V, 42, "normal")
    text = admission.with_table_ref(comment, ref, 400)
    assert text == (f"swapaware:v1 id={admission.PLACEHOLDER_ID} tbl={V}:0000042n model=m action=share shards=2 "
                    "why=fits_in_shards")
    assert admission.parse_table_ref(text) == ref
    assert policy.parse_admin_comment(text)["action"] == "share"
    assert admission.with_table_ref(comment, ref, 60) is None  # the token itself would be cut
    assert admission.with_table_ref("swapaware:v1 id=abc", ref, 400) is None
    assert admission.parse_table_ref(text.replace(":0000042n", ":42n")) is None
    assert admission.parse_table_ref("swapaware:v1 id=x") is None
    assert admission.parse_table_ref("") is None
    star = admission.TableRef(V, 1, "*")
    assert admission.parse_table_ref(admission.with_table_ref(comment, star, 400)) == star
    assert len(star.token) == len(ref.token) == admission.TOKEN_CHARS


@pytest.mark.parametrize("smq, ocmq, states", [
    (0.25, 0.75, {"short", "normal", "long", "unknown"}),
    (0.0, 0.75, {"normal", "long", "unknown"}),
    (0.25, 0.0, {"short", "normal", "unknown"}),
    (0.5, 0.25, {"short", "long", "unknown"}),  # every fresh queue not short is long
    (0.0, 0.0, {"normal", "unknown"}),
])
def test_state_queues_reach_exactly_the_states_some_queue_reaches(smq, ocmq, states):
    c = cfg(share_min_queue=smq, overcommit_compute_min_queue=ocmq)
    queues = admission.state_queues(c)
    assert set(queues) == states
    for state, q in queues.items():
        assert queue_rules.queue_gate_state(q, "any", c) == state
    reached = {queue_rules.queue_gate_state(QueueState(p / 100, 1), "", c) for p in range(0, 300)}
    assert reached | {"unknown"} == states


def test_the_gate_file_names_each_listed_qos_and_the_rest():
    c = cfg(share_min_queue=0.25, overcommit_compute_min_queue=0.75, queue_poll_s=10.0)
    snap = QueueState(pending_gpus=3.0, total_gpus=4, age_s=2.0, ahead_by_qos=(("high", 0.0), ("normal", 3.0)))
    g = admission.gate_file(snap, c, now=1000.0)
    assert g["views"] == {"high": "short", "normal": "long"} and g["other"] == "long"
    assert g["valid_until"] == pytest.approx(998.0 + 30.0) and g["format"] == admission.GATE_FORMAT
    whole = admission.gate_file(snap, dataclasses.replace(c, policy=dataclasses.replace(c.policy,
                                                                                    queue_per_qos=False)), 1000.0)
    assert whole["views"] == {"": "long"} and whole["other"] == "long"
    assert admission.gate_file(None, c, 1000.0)["other"] == "unknown"
    assert "rpc_only" not in g and "controller" not in g
    sent = admission.gate_file(snap, c, 1000.0, rpc_only="shards refused", controller="ctl2")
    assert (sent["rpc_only"], sent["controller"], sent["views"]) == ("shards refused", "ctl2", g["views"])
    assert admission.gate_file(None, c, 1000.0, controller="ctl2")["controller"] == "ctl2"
    stale = dataclasses.replace(snap, age_s=31.0)
    assert queue_rules.queue_gate_state(stale, "high", c) == "unknown"


def _job() -> JobRequest:
    return JobRequest(user="u", account="a", partition="p", job_name="n", script_fingerprint="f",
                      gpu=GpuRequest(GresKind.GPU, 1, "", "tres_per_node", "gres/gpu:1"))


def test_decide_under_each_state_queue_takes_that_branch():
    c = cfg(share_min_queue=0.25, overcommit_compute_min_queue=0.75)
    stats = {KeyLevel.CLASS: ClassStats(samples=3, runs=3, ewma_peak_bytes=2 * 1024**3, max_peak_bytes=2 * 1024**3)}
    codes = {}
    for state, q in admission.state_queues(c).items():
        d = policy.decide(_job(), stats, c, decision_id=admission.PLACEHOLDER_ID, now=0.0, job_class="k",
                          gres_fields={"tres_per_node": "gres/gpu:1"}, queue=q)
        codes[state] = {r.code for r in d.reasons}
    assert ReasonCode.QUEUE_SHORT in codes["short"] and ReasonCode.QUEUE_UNKNOWN in codes["unknown"]
    assert not {ReasonCode.QUEUE_SHORT, ReasonCode.QUEUE_UNKNOWN} & codes["normal"]


def test_table_decision_is_what_the_plugin_would_set_or_nothing():
    rw = Rewrite(tres_per_node="gres/shard:2", tres_bind="", site_factor=3, admin_comment="c", user_message="m")
    assert admission.table_decision(rw) == {"set": {"tres_per_node": "gres/shard:2", "tres_bind": "", "site_factor": 3,
                                                    "admin_comment": "c"}, "message": "m"}
    assert admission.table_decision(Rewrite(admin_comment="c")) == {"set": {"admin_comment": "c"}}
    assert admission.table_decision(Rewrite(tres_per_node="gres/shard:2;x", admin_comment="c")) is None
    assert admission.table_decision(Rewrite(tres_per_job="x" * 4097, admin_comment="c")) is None
    assert admission.table_decision(Rewrite(site_factor=2**31, admin_comment="c")) is None


def test_an_entry_alike_in_every_state_is_held_once():
    same = {s: Rewrite(admin_comment="c") for s in ("short", "normal", "unknown")}
    assert admission.entry_refs(V, 3, same) == {"*": admission.TableRef(V, 3, "*")}
    differ = dict(same, normal=Rewrite(tres_per_node="gres/shard:1", admin_comment="c"))
    assert admission.entry_refs(V, 3, differ) == {s: admission.TableRef(V, 3, s) for s in differ}
    assert admission.tokenised(Rewrite(), admission.TableRef(V, 3, "*"), 400) is None  # nothing to name the table


def test_keys_read_stop_at_the_key_the_estimate_came_from():
    c = cfg()
    keys = {KeyLevel.CLASS: "c", KeyLevel.USER_NAME: "u/n", KeyLevel.ACCOUNT: "a", KeyLevel.PARTITION: "p"}
    known = ClassStats(samples=50, runs=50, ewma_peak_bytes=1.0, max_peak_bytes=1)
    assert admission.keys_read(keys, {KeyLevel.CLASS: known}, c, user="u") == ("c", "u/n")
    assert admission.keys_read(keys, {KeyLevel.ACCOUNT: known}, c, user="u") == ("c", "u/n", "a")
    assert admission.keys_read(keys, {}, c, user="u") == ("c", "u/n", "a", "p")  # nothing usable: every key was read
    assert admission.keys_read(keys, {KeyLevel.CLASS: ClassStats(samples=0)}, c, user="u") == ("c", "u/n", "a", "p")
    # an account known from one other user's runs alone is not usable for u's job: it read on
    others = ClassStats(samples=50, runs=50, max_peak_bytes=1, users=(UserFigure("v", 50, 1),))
    assert admission.keys_read(keys, {KeyLevel.ACCOUNT: others}, c, user="u") == ("c", "u/n", "a", "p")
    assert admission.keys_read(keys, {KeyLevel.ACCOUNT: others}, c, user="v") == ("c", "u/n", "a")


def test_template_reasons_say_the_gate_state_not_made_up_figures():
    c = cfg(share_min_queue=0.25, overcommit_compute_min_queue=0.75)
    queues = admission.state_queues(c)
    stats = {KeyLevel.CLASS: ClassStats(samples=3, runs=3, ewma_peak_bytes=2 * 1024**3, max_peak_bytes=2 * 1024**3)}
    d = policy.decide(_job(), stats, c, decision_id=admission.PLACEHOLDER_ID, now=0.0, job_class="k",
                      gres_fields={"tres_per_node": "gres/gpu:1"}, queue=queues["short"])
    assert "of 1 GPUs" in next(r.message for r in d.reasons if r.code is ReasonCode.QUEUE_SHORT)  # made up
    said = admission.template_reasons(d.reasons, "short", c)
    assert [r.code for r in said] == [r.code for r in d.reasons]
    short = next(r.message for r in said if r.code is ReasonCode.QUEUE_SHORT)
    assert "queue gate 'short'" in short and "25.0%" in short and "of 1 GPUs" not in short
    others = [(r.code, r.message) for r in d.reasons if r.code is not ReasonCode.QUEUE_SHORT]
    assert [(r.code, r.message) for r in said if r.code is not ReasonCode.QUEUE_SHORT] == others


# --- the file (core/admission_format.py) ----------------------------------------------------------

def _template(entry: int, letter: str, cut: int = 200) -> str:
    comment = f"swapaware:v1 id={admission.PLACEHOLDER_ID} action=share shards=2 why=q1,q2 " + "x" * 80
    ref = admission.TableRef(V, entry, admission.LETTER_STATE[letter])
    return admission.with_table_ref(comment, ref, cut)


def test_the_file_holds_each_decision_once_and_reads_back_whole():
    from policy_service.core import admission_format as fmt
    same = {"set": {"tres_per_node": "gres:shard:2", "site_factor": 3}, "message": "shared \t\n"}
    entries = {}
    for n in range(5):
        key = admission.SEP.join([f"u{n}", "a\tb" if n == 1 else "", "c\nd\\" if n == 2 else ""])
        states = {"*": "a"} if n % 2 else {"short": "s", "long": "l"}
        entries[key] = {"i": 1000 + n, **{s: {**same, "set": {**same["set"], "admin_comment": _template(1000 + n, g,
                                                                                                       cut=120)}}
                                          for s, g in states.items()}}
    doc = admission.table_file(V, 1.0, 2.0, "24.11", "enforce", True, entries)
    data = fmt.render_table(doc)
    lines = data.decode().split("\n")
    assert lines[0] == admission.TABLE_FORMAT and lines[-2:] == [fmt.END, ""]
    assert len(lines) == 2 + 1 + 5 + 2            # one decision line for all entries and states
    assert V not in lines[2] and fmt.TOKEN_PLACEHOLDER in lines[2]
    assert fmt.read_table(data) == doc
    # the template was cut with the token in it: the shared one is cut at the same place
    assert all(len(d["set"]["admin_comment"]) == 120 for e in entries.values() for s, d in e.items() if s != "i")
    for cut in (data[:-1], data[:len(data) // 2], data.replace(b"\t0001001\t", b"\t1001\t")):
        with pytest.raises(ValueError):
            fmt.read_table(cut)


def test_the_file_in_pieces_is_the_same_file_and_a_repeated_digest_is_left_out():
    from policy_service.core import admission_format as fmt
    doc = admission.table_file(V, 1.0, 2.0, "26.05", "enforce", False, {})
    short, every = admission.LETTER_STATE["s"], admission.LETTER_STATE["a"]
    entries = [("d1", "k1", 7, [(every, "one"), (short, "two")]), ("d2", "k2", 8, [(every, "two")]),
               ("d1", "k1-older", 9, [(every, "three")])]  # the same digest as k1: the newer key is kept
    whole = b"".join(fmt.table_pieces(doc, fmt.table_body(entries)))
    lines = whole.decode().split("\n")
    assert lines[2:4] == ["one", "two"] and "three" not in lines      # each decision once, the left-out key's none
    assert [line.split("\t")[1] for line in lines[4:6]] == ["k1", "k2"] and lines[6] == fmt.END
    assert '"decisions":2' in lines[1] and '"entries":2' in lines[1]
    small = list(fmt.table_pieces(doc, fmt.table_body(entries, piece_bytes=4)))
    assert len(small) > 3 and b"".join(small) == whole                 # cut anywhere, the same bytes
    assert '"entries":null' in b"".join(fmt.table_pieces(doc, fmt.table_body(None))).decode()


def test_a_decision_without_a_whole_token_is_written_as_it_is():
    from policy_service.core import admission_format as fmt
    for d in ("not an object", {"set": {"admin_comment": f"id={admission.PLACEHOLDER_ID} tbl=short"}}, {"set": 1}):
        assert fmt.shared(d) == d
