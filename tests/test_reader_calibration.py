"""Placement calibrated on the reader (issue 26): reader profiles, measuring them, and ``ordering="calibrated"``."""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
import pytest

from rag_opt.errors import InvalidInputError, ProfileMismatchError
from rag_opt.orderers.reader_profiles import ReaderProfile, ReaderProfileStore, reader_key


def _u_shaped(n: int) -> np.ndarray:
    w = np.full(n, 0.2)
    w[0], w[-1] = 0.9, 0.6
    return w


def _nq_calibration(n_docs: int):
    from rag_opt.training.datasets import nq_split, read_nq_multidoc
    from tests.helpers import data_path

    records = read_nq_multidoc(data_path("nq_multidoc", "public.jsonl.gz"), min_distractors=n_docs - 1)
    return nq_split(records, "calibration")


class EdgeReader:
    """A fake API reader with a strong position bias: it answers with the first and the last document only."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, messages: list[dict[str, str]]) -> str:
        self.calls += 1
        docs = re.findall(r"^Document \[\d+\]\(Title: [^)]*\) (.*)$", messages[-1]["content"], flags=re.M)
        return f"{docs[0]} {docs[-1]}"


def test_a_reader_profile_round_trips_and_is_found_by_its_target_name(tmp_path):
    store = ReaderProfileStore(tmp_path)
    profile = ReaderProfile("Qwen/Qwen2.5-7B-Instruct", 5, "accuracy", _u_shaped(5), 40, {"k": "v"})
    path = store.put(profile)
    assert path.parent == tmp_path and not list(tmp_path.glob("*.tmp"))
    for name in ("Qwen/Qwen2.5-7B-Instruct", "hf:Qwen/Qwen2.5-7B-Instruct", " Qwen/Qwen2.5-7B-Instruct "):
        got = store.get(name, 5)
        assert got is not None and got.method == "accuracy" and got.metadata == {"k": "v"}
        np.testing.assert_allclose(got.slot_weight, _u_shaped(5))
    assert store.get("Qwen/Qwen2.5-7B-Instruct", 6) is None and store.get("gpt-4o", 5) is None
    assert store.available("hf:Qwen/Qwen2.5-7B-Instruct") == [5]
    assert reader_key("hf: gpt-4o ") == "gpt-4o"


def test_a_bad_reader_profile_file_is_refused_by_name(tmp_path):
    store = ReaderProfileStore(tmp_path)
    path = store.put(ReaderProfile("r", 3, "attention", np.ones(3), 2))
    path.write_text("{not json")
    with pytest.raises(ProfileMismatchError, match="not valid JSON"):
        store.get("r", 3)
    data = ReaderProfile("r", 3, "attention", np.ones(3), 2).to_dict()
    path.write_text(json.dumps({**data, "slot_weight": [1.0, 2.0]}))
    with pytest.raises(ProfileMismatchError, match="2,"):
        store.get("r", 3)
    path.write_text(json.dumps({**data, "reader": "someone-else"}))
    with pytest.raises(ProfileMismatchError, match="someone-else"):
        store.get("r", 3)
    with pytest.raises(ProfileMismatchError, match="method"):
        ReaderProfile("r", 3, "vibes", np.ones(3), 2)  # type: ignore[arg-type]
    with pytest.raises(ProfileMismatchError, match="non-finite"):
        ReaderProfile("r", 3, "attention", np.array([1.0, np.nan, 1.0]), 2)


def test_accuracy_per_slot_finds_a_readers_position_bias_within_the_request_bound():
    from rag_opt.training.reader_calibration import reader_accuracy_profile, slot_grid

    assert slot_grid(20) == [0, 4, 9, 14, 19] and slot_grid(10) == [0, 4, 9] and slot_grid(1) == [0]
    reader = EdgeReader()
    profile = reader_accuracy_profile(reader, "edge", 10, _nq_calibration(10), max_requests=30, progress=False)
    assert reader.calls == 30 == profile.metadata["requests"]  # 10 questions x 3 measured slots
    assert profile.contexts == 10 and profile.metadata["measured_slots"] == [1, 5, 10]
    first, middle, last = profile.metadata["accuracy"]
    assert first >= 0.7 and last >= 0.7 and middle <= 0.2  # the gold passage is read only at the edges
    w = profile.slot_weight
    assert w.shape == (10,) and w[0] == first and w[4] == middle and w[9] == last  # measured slots exact
    assert w[2] == pytest.approx((first + middle) / 2)  # slots between are interpolated
    with pytest.raises(InvalidInputError, match="less than one question per measured slot"):
        reader_accuracy_profile(reader, "edge", 10, _nq_calibration(10), max_requests=2, progress=False)


def test_calibrated_placement_puts_the_best_document_where_the_reader_reads_best(tmp_path, monkeypatch):
    from rag_opt import ContextOptimizer

    monkeypatch.setenv("RAG_OPT_CALIBRATION_DIR", str(tmp_path))
    weights = np.array([0.3, 0.1, 0.2, 0.9])  # this reader reads the last slot best, then the first
    ReaderProfileStore().put(ReaderProfile("my-reader", 4, "accuracy", weights, 50))
    docs = [
        {"id": "a", "text": "Paris is the capital of France."},
        {"id": "b", "text": "Bananas are yellow fruit grown in the tropics."},
        {"id": "c", "text": "The Eiffel Tower stands in Paris, the capital of France, since 1889."},
        {"id": "d", "text": "Snow falls in winter in many northern countries."},
    ]
    question = "When was the Eiffel Tower in the capital of France built?"
    opt = ContextOptimizer(tier="lexical", ordering="calibrated", reader="my-reader")
    result = opt.optimize(question, docs, ratio=1.0)
    assert result.placement_profile == "reader profile of my-reader (accuracy, 4 documents, 50 questions per slot)"
    relevance = {d.id: d for d in result.documents}
    best = max(relevance, key=lambda i: relevance[i].score or 0.0)
    assert best == "c" and result.documents[-1].id == "c"  # the reader's best slot holds the best document
    # a number of documents nobody measured: the nearest profile, resampled, and said so
    three = opt.optimize(question, docs[:3], ratio=1.0)
    assert three.placement_profile is not None and "resampled to 3" in three.placement_profile
    assert any("no reader profile of my-reader for 3 documents" in w for w in three.warnings)
    # the reader defaults to the request's target: a target with a profile is placed by it
    ReaderProfileStore().put(ReaderProfile("gpt-4o", 4, "accuracy", weights[::-1].copy(), 20))
    by_target = ContextOptimizer(tier="lexical", ordering="calibrated").optimize(
        question, docs, ratio=1.0, target="gpt-4o"
    )
    assert (by_target.placement_profile or "").startswith("reader profile of gpt-4o")
    assert by_target.documents[0].id == "c"
    with pytest.raises(InvalidInputError, match="reader"):
        ContextOptimizer(reader=" ")


@pytest.mark.model
def test_without_a_reader_profile_the_proxys_profile_places_and_is_named(tmp_path, monkeypatch):
    from rag_opt import ContextOptimizer
    from tests.helpers import EXAMPLE_DOCS

    monkeypatch.setenv("RAG_OPT_CALIBRATION_DIR", str(tmp_path))  # no reader profiles here
    opt = ContextOptimizer(ordering="calibrated", target="gpt-4o")
    result = opt.optimize("What is the capital of France?", EXAMPLE_DOCS[:4], ratio=1.0)
    assert result.placement_profile is not None and result.placement_profile.startswith("proxy profile of embedded:")


def _edge_reader_app(seen: list[dict[str, Any]]) -> Any:
    reader = EdgeReader()

    from tests.upstream_server import request_body

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = await request_body(scope, receive, send)
        if body is None:
            return
        req = json.loads(body)
        seen.append({"path": scope["path"], "headers": dict(scope["headers"]), "body": req})
        answer = {"choices": [{"message": {"role": "assistant", "content": reader(req["messages"])}}]}
        out = json.dumps(answer).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": out})

    return app


def test_calibrate_reader_through_an_openai_upstream_writes_the_profile(tmp_path, capsys):
    from rag_opt.cli import main
    from tests.helpers import data_path
    from tests.upstream_server import ServerThread

    data = data_path("nq_multidoc", "public.jsonl.gz")
    seen: list[dict[str, Any]] = []
    with ServerThread(_edge_reader_app(seen)) as server:
        args = ["calibrate", "--reader", "edge-llm", "--n-docs", "10", "--data", str(data), "--store", str(tmp_path)]
        args += ["--upstream", f"{server.url}/v1", "--upstream-api-key", "sk-reader-key", "--max-requests", "12"]
        assert main(args) == 0
    out = capsys.readouterr().out
    assert "12 requests" in out and len(seen) == 12
    assert seen[0]["path"] == "/v1/chat/completions"
    assert seen[0]["headers"][b"authorization"] == b"Bearer sk-reader-key"
    assert seen[0]["body"]["model"] == "edge-llm" and seen[0]["body"]["temperature"] == 0
    assert "Question:" in seen[0]["body"]["messages"][-1]["content"]
    profile = ReaderProfileStore(tmp_path).get("edge-llm", 10)
    assert profile is not None and profile.method == "accuracy" and profile.metadata["requests"] == 12
    assert profile.slot_weight[0] > profile.slot_weight[4] < profile.slot_weight[9]
    # a second run reuses it (no request); a broken upstream is a clear error
    assert main(args) == 0 and len(seen) == 12
    bad = ["calibrate", "--reader", "edge-llm", "--n-docs", "10", "--data", str(data), "--store", str(tmp_path)]
    assert main([*bad, "--upstream", "http://127.0.0.1:9/v1", "--force", "--max-requests", "3"]) != 0
    assert "the reader's upstream failed" in capsys.readouterr().err


@pytest.mark.model
def test_calibrate_a_local_reader_by_its_attention(tmp_path, capsys):
    from rag_opt.cli import main
    from tests.helpers import data_path

    data = data_path("nq_multidoc", "public.jsonl.gz")
    args = ["calibrate", "--reader", "embedded:smollm2-135m", "--n-docs", "3", "--contexts", "2"]
    assert main([*args, "--data", str(data), "--store", str(tmp_path), "--plot", str(tmp_path / "r.png")]) == 0
    profile = ReaderProfileStore(tmp_path).get("embedded:smollm2-135m", 3)
    assert profile is not None and profile.method == "attention" and profile.contexts == 2
    assert profile.slot_weight.shape == (3,) and (profile.slot_weight > 0).all()
    assert (tmp_path / "r.png").stat().st_size > 0


@pytest.mark.model
def test_calibrate_a_local_reader_by_its_accuracy(tmp_path, capsys):
    from rag_opt.cli import main
    from tests.helpers import data_path

    data = data_path("nq_multidoc", "public.jsonl.gz")
    # a cached profile measured by attention is not taken for the accuracy profile asked for
    attention = ReaderProfile("embedded:smollm2-135m", 3, "attention", np.array([0.5, 0.2, 0.3]), contexts=1)
    ReaderProfileStore(tmp_path).put(attention)
    args = ["calibrate", "--reader", "embedded:smollm2-135m", "--n-docs", "3", "--method", "accuracy"]
    assert main([*args, "--max-requests", "4", "--data", str(data), "--store", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "was measured by attention: measuring by accuracy" in out and "4 answers from embedded:smollm2-135m" in out
    profile = ReaderProfileStore(tmp_path).get("embedded:smollm2-135m", 3)
    assert profile is not None and profile.method == "accuracy" and profile.contexts == 2
    assert profile.metadata["measured_slots"] == [1, 3] and profile.metadata["requests"] == 4
    # accuracies of 2 questions: each measured slot is 0, 0.5 or 1, and the middle slot is interpolated
    acc = profile.metadata["accuracy"]
    assert all(a in (0.0, 0.5, 1.0) for a in acc)
    assert profile.slot_weight.tolist() == pytest.approx([acc[0], (acc[0] + acc[1]) / 2, acc[1]])
    # without --method the cached profile is used, whatever measured it
    assert (
        main(
            [
                "calibrate",
                "--reader",
                "embedded:smollm2-135m",
                "--n-docs",
                "3",
                "--data",
                str(data),
                "--store",
                str(tmp_path),
            ]
        )
        == 0
    )
    assert "using cached" in capsys.readouterr().out


def test_calibrate_reader_refuses_attention_through_an_api(tmp_path, capsys):
    from rag_opt.cli import main
    from tests.helpers import data_path

    data = data_path("nq_multidoc", "public.jsonl.gz")
    args = ["calibrate", "--reader", "edge-llm", "--n-docs", "3", "--data", str(data), "--store", str(tmp_path)]
    assert main([*args, "--upstream", "http://127.0.0.1:9/v1", "--method", "attention"]) != 0
    assert "--method attention needs a local model" in capsys.readouterr().err
