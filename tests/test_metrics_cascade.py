"""MedEvalKit's scoring cascade: rules, similarity, the judge (its prompt, verdicts, cache and agreement), and the judge
backends: a local transformers model, and an OpenAI-compatible endpoint served around that model by the test (a
stand-in for vLLM or a hosted API, which CI cannot reach)."""

from __future__ import annotations

import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from gx_ray.metrics.cascade import (
    JUDGE_PROMPT_VERSION,
    REPORT_PROMPT,
    JudgeCache,
    Scored,
    cascade_metrics,
    normalise,
    parse_verdict,
    question_prompt,
    score_answer,
    token_f1,
)
from gx_ray.models.judge import endpoint_judge, local_judge
from tests.test_metrics_mcq import NOISE, TWO_OPTIONS, _render_letter

OPTIONS = ["Borrmann I", "Borrmann II", "Borrmann III", "Borrmann IV"]


def test_normalisation_and_token_f1_follow_squad():
    assert normalise("The  Antrum, of the stomach!") == "antrum of stomach"
    assert token_f1("the gastric antrum", "antrum") == pytest.approx(2 * 0.5 * 1 / 1.5)
    assert token_f1("", "") == 1.0 and token_f1("body", "") == 0.0
    rng = np.random.default_rng(0)
    words = ["body", "antrum", "cardia", "lesser", "greater", "curvature", "wall"]
    for _ in range(200):
        a, b = (" ".join(rng.choice(words, rng.integers(1, 5))) for _ in range(2))
        assert 0 <= token_f1(a, b) <= 1 and token_f1(a, b) == pytest.approx(token_f1(b, a))
        assert token_f1(a, a) == 1.0


@pytest.mark.parametrize(
    "answer, stage, choice",
    [
        ("C", "rule", 2),
        ("(B)", "rule", 1),
        ("The answer is D.", "rule", 3),
        ("borrmann iii", "rule", 2),  # an option's own text
        ("It looks like a Borrmann IV lesion to me", "similarity", 3),
        ("no idea", "unparsed", None),
        ("", "unparsed", None),
    ],
)
def test_a_multiple_choice_answer_is_read_by_rule_then_by_similarity(answer, stage, choice):
    scored = score_answer("mcq", answer, "C", options=OPTIONS)
    assert (scored.stage, scored.choice) == (stage, choice)
    assert scored.correct == (None if choice is None else choice == 2)
    assert score_answer("mcq", answer, "Borrmann III", options=OPTIONS) == scored  # the reference as text too


def test_open_answers_go_to_the_judge_only_when_the_rules_do_not_match_and_verdicts_are_cached(tmp_path):
    asked = []

    def judge(prompt: str) -> str:
        # a stand-in for an LLM judge (a rule on the prompt), to test the cascade's use of verdicts: the real judge
        # backends are tested below
        asked.append(prompt)
        answer = prompt.split("Model answer: ")[1].split("\n")[0]
        return "<think>…</think><judge>0</judge>" if "antrum" in answer else "<judge>1</judge>"

    cache = JudgeCache(tmp_path / "verdicts.json")
    question, reference = "Where is the lesion?", "gastric antrum"
    assert score_answer("open", "Gastric antrum.", reference, question, judge=judge, cache=cache).stage == "rule"
    assert not asked  # the rules decided: no judge
    hit = score_answer("open", "in the antrum of the stomach", reference, question, judge=judge, cache=cache)
    miss = score_answer("open", "the cardia", reference, question, judge=judge, cache=cache)
    assert (hit.correct, hit.stage, miss.correct, miss.stage) == (True, "judge", False, "judge") and len(asked) == 2
    assert "Reference answer: gastric antrum" in asked[0] and "<judge></judge>" in asked[0]
    # the same question, reference and answer again: from the cache, on disk too
    score_answer("open", "the cardia", reference, question, judge=judge, cache=cache)
    again = JudgeCache(tmp_path / "verdicts.json")
    assert score_answer("open", "the cardia", reference, question, judge=judge, cache=again).correct is False
    assert len(asked) == 2
    assert json.loads(next(iter(again.verdicts)))[0] == JUDGE_PROMPT_VERSION
    # a reply without a verdict is a parse failure, not a wrong answer
    mute = score_answer("open", "the pylorus", reference, question, judge=lambda p: "I think so", cache=cache)
    assert (mute.correct, mute.stage) == (None, "unparsed")
    # without a judge an open answer the rules did not match is wrong, as MedEvalKit's exact match has it
    assert score_answer("open", "in the antrum of the stomach", reference, question) == Scored(False, "rule")
    assert score_answer("open", "The answer is: gastric antrum.", reference, question) == Scored(True, "rule")


def test_verdicts_follow_medevalkits_convention():
    assert parse_verdict("<think>ok</think><judge>0</judge>") is True
    assert parse_verdict("<judge> 1 </judge>") is False
    assert parse_verdict("correct") is None and parse_verdict(None) is None


def test_the_metrics_keep_parse_failures_apart_and_measure_judge_rule_agreement():
    scored = [
        Scored(True, "rule", judge=True),
        Scored(False, "similarity", judge=True),
        Scored(True, "judge", judge=True),
        Scored(None, "unparsed"),
        Scored(True, "rule"),
    ]
    metrics = cascade_metrics(scored)
    assert metrics["accuracy"] == 60.0 and metrics["parse_failure_rate"] == 20.0
    assert (metrics["decided_by_rule"], metrics["decided_by_similarity"], metrics["decided_by_judge"]) == (40, 20, 20)
    assert metrics["judge_rule_agreement"] == 50.0  # audited: agrees on the first, not on the second
    assert all(math.isnan(v) for v in cascade_metrics([]).values())
    audited = score_answer("close", "antrum", "antrum", "Where?", judge=lambda p: "<judge>0</judge>", audit=True)
    assert (audited.stage, audited.judge) == ("rule", True)


@pytest.fixture(scope="module")
def tiny_judge_model(tmp_path_factory):
    """A randomly initialised one-layer causal LM with the offline MiniLM tokenizer, saved as a local model folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from gx_ray.models.text import offline_tokenizer

    torch.manual_seed(0)
    tokenizer = offline_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    folder = tmp_path_factory.mktemp("judge")
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def test_a_local_model_judges_and_an_openai_compatible_endpoint_around_it_answers_the_same(tiny_judge_model):
    """The endpoint is a minimal OpenAI-compatible server the test starts around the local model: a stand-in for
    vLLM or a hosted API. A random model names no verdict, so its answers count as parse failures."""
    ask = local_judge(tiny_judge_model, max_new_tokens=8)
    prompt = "Question: Where?\nReference answer: antrum\nModel answer: body"
    reply = ask(prompt)
    assert isinstance(reply, str) and reply == ask(prompt)  # greedy: the same reply twice
    seen = []

    class ChatCompletions(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (the http.server interface)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((self.path, body["model"], self.headers.get("Authorization")))
            content = ask(body["messages"][-1]["content"])
            data = json.dumps({"choices": [{"message": {"role": "assistant", "content": content}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), ChatCompletions)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        remote = endpoint_judge(f"http://127.0.0.1:{server.server_port}/v1", "tiny-judge", api_key="k")
        assert remote(prompt) == reply
        assert seen == [("/v1/chat/completions", "tiny-judge", "Bearer k")]
        scored = score_answer("open", "body", "antrum", "Where?", judge=remote)
        assert scored.stage in ("judge", "unparsed") and scored.judge == parse_verdict(ask(scored_prompt("body")))
    finally:
        server.shutdown()


def scored_prompt(answer: str) -> str:
    from gx_ray.metrics.cascade import JUDGE_PROMPT

    return JUDGE_PROMPT.format(question="Where?", reference="antrum", answer=answer)


def test_questions_are_put_in_medevalkits_words():
    assert question_prompt("mcq", "Which site?", ["cardia", "body"]) == (
        "Question: Which site? Options: A. cardia B. body "
        "Answer with the option's letter from the given choices directly."
    )
    assert question_prompt("close", "Is the wall thickened?").endswith(
        "Answer the question using a single word or phrase."
    )
    assert question_prompt("open", "Describe the lesion.") == "Describe the lesion. Answer the question concisely."
    assert REPORT_PROMPT.endswith("Findings: {} Impression: {}.")
    # the letter a model answers with is read back by the cascade's rules
    assert score_answer("mcq", "B", "body", options=["cardia", "body"]).correct
    with pytest.raises(ValueError, match="needs its options"):
        question_prompt("mcq", "Which site?")


# --------------------------------------------------------------------------------------------------------------
# the cascade on generated answers: two options named, options whose text starts with a letter, negations, judge tags

CASES = 300
PHRASES = [
    "gastric wall thickening", "perigastric lymph node", "serosal invasion", "liver metastasis", "ascites",
    "ulcerated mucosa", "Borrmann type lesion", "antral mass", "diffuse infiltration", "fat stranding",
]  # fmt: skip


def test_an_answer_naming_two_options_is_a_parse_failure_in_the_cascade():
    for case in range(CASES):
        rng = np.random.default_rng([40, case])
        options = [str(p) for p in rng.choice(PHRASES, int(rng.integers(3, 7)), replace=False)]
        x, y, z = (str(letter) for letter in rng.choice(list("ABCDEF"[: len(options)]), 3, replace=False))
        letters = {name: _render_letter(rng, letter) for name, letter in zip("xyz", (x, y, z), strict=True)}
        answer = str(rng.choice(NOISE)) + str(rng.choice(TWO_OPTIONS)).format(**letters)
        for reference in (x, y, options["ABCDEF".index(x)]):
            assert score_answer("mcq", answer, reference, options=options) == Scored(None, "unparsed"), (case, answer)


GERMS = ["C. difficile", "E. coli", "H. pylori", "B. fragilis", "A. baumannii", "D. dubius", "F. nucleatum"]


def test_an_options_own_text_wins_over_a_letter_read_from_its_start():
    """Options such as "C. difficile colitis" (option B): as the reference, as the answer, and quoted after the
    answer's letter, the text is its own option, not the option its first letter names."""
    for case in range(CASES):
        rng = np.random.default_rng([41, case])
        count = int(rng.integers(2, 7))
        germs = [str(g) for g in rng.choice(GERMS, count, replace=False)]
        options = [f"{germ} {rng.choice(['colitis', 'infection', 'sepsis', 'gastritis'])}" for germ in germs]
        k = int(rng.integers(0, count))
        letter = "ABCDEF"[k]
        text = options[k]
        varied = str(rng.choice([text, text.lower(), text.upper(), f"{text}.", f" {text} "]))
        for answer, reference in [
            (letter, varied), (varied, letter), (varied, varied), (f"{letter}. {text}", text),
            (f"The answer is {letter}: {text.lower()}", letter), (f"({letter.lower()}) {text}", varied),
        ]:  # fmt: skip
            scored = score_answer("mcq", answer, reference, options=options)
            where = (case, options, answer, reference)
            assert (scored.correct, scored.stage, scored.choice) == (True, "rule", k), where
        wrong = "ABCDEF"[(k + 1) % count]
        assert score_answer("mcq", wrong, varied, options=options).correct is False


NEGATIONS = ["no {p}", "not {p}", "without {p}", "absence of {p}", "{p} absent", "negative for {p}", "{p} not seen"]


def _phrase(rng: np.random.Generator) -> str:
    words = "lymph node metastasis gastric wall thickening serosal invasion liver perigastric ulcer".split()  # noqa: SIM905
    return " ".join(str(w) for w in rng.choice(words, int(rng.integers(1, 5)), replace=False))


def test_a_close_ended_answer_is_right_only_when_it_is_the_reference_and_never_by_dropping_a_negation():
    """MedEvalKit's close-ended rule: the normalised final answer equals the reference; so a phrase never matches its
    negation however long it is (token F1 of "p" against "no p" reaches 0.8 from two words on)."""
    for case in range(CASES):
        rng = np.random.default_rng([42, case])
        phrase = _phrase(rng)
        negated = str(rng.choice(NEGATIONS)).format(p=phrase)
        for answer, reference in ((phrase, negated), (negated, phrase)):
            said = str(rng.choice(["{}", "The answer is {}.", "Answer: {}", "\\boxed{{{}}}", "{}."])).format(answer)
            assert score_answer("close", said, reference) == Scored(False, "rule"), (case, said, reference)
        forms = ["{}", "The {}.", "Answer: {}", "The answer is {}!", "\\boxed{{{}}}", "<answer>{}</answer>"]
        restated = str(rng.choice(forms))
        for text in (phrase, negated):
            said = restated.format(str(rng.choice([text, text.upper(), text.capitalize()])))
            assert score_answer("close", said, text) == Scored(True, "rule"), (case, said, text)


def test_a_yes_no_answer_is_right_when_it_says_the_references_word_and_not_the_other():
    for case in range(CASES):
        rng = np.random.default_rng([43, case])
        reference, said = str(rng.choice(["yes", "no"])), str(rng.choice(["yes", "no"]))
        phrase = _phrase(rng)
        if said == "yes":
            answer = str(rng.choice(["Yes", "yes.", "Yes, {p} is present.", "The answer is yes", "YES"]))
        else:
            answer = str(rng.choice(["No", "no.", "No, there is no {p}.", "The answer is no", "NO"]))
        mixed = str(rng.choice(["Yes, but no {p}.", "yes or no", "No... yes, {p}", "Yes and no"]))
        assert score_answer("close", answer.format(p=phrase), reference).correct is (said == reference), (case, answer)
        assert score_answer("close", mixed.format(p=phrase), reference) == Scored(False, "rule"), (case, mixed)


def test_a_judge_reply_whose_verdict_tags_disagree_names_no_verdict():
    fillers = ["", "<think>The answer names the antrum.</think>", "So:", "\n", "Let me check. "]
    for case in range(CASES):
        rng = np.random.default_rng([44, case])
        tags = [str(rng.choice(["0", "1", " 0 ", "1\n", "", "maybe"], p=[0.4, 0.4, 0.05, 0.05, 0.05, 0.05]))]
        tags += [str(rng.choice(["0", "1"])) for _ in range(int(rng.integers(0, 4)))]
        rng.shuffle(tags)
        reply = "".join(f"{rng.choice(fillers)}<{rng.choice(['judge', 'JUDGE'])}>{t}</judge>" for t in tags)
        values = {t.strip() for t in tags} - {""}
        expected = values == {"0"} if values in ({"0"}, {"1"}) else None
        assert parse_verdict(reply) is expected, (case, reply)
        scored = score_answer("open", "the body", "antrum", "Where?", judge=lambda prompt, reply=reply: reply)
        assert (scored.correct, scored.stage) == (expected, "judge" if expected is not None else "unparsed")
