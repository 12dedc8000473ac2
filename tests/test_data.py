"""jaxgrpo.data: fixtures in every format load with the right mapping and template as expected;
long prompts are dropped and counted; the iterator is deterministic and resumable; host slicing."""

from __future__ import annotations

import os

import numpy as np
import pytest

from jaxgrpo import data
from jaxgrpo.tasks.arithmetic import build_tokenizer

FIX = os.path.join(os.path.dirname(__file__), "fixtures")


@pytest.fixture(scope="module")
def tok():
  return build_tokenizer()


@pytest.mark.parametrize(
  "fname, prompt0, answer0, extra_col",
  [
    ("openrs.jsonl", "What is $\\frac{1}{2} + \\frac{1}{3}$?", "\\frac{5}{6}", "level"),
    ("math500.jsonl", "Find $\\sqrt{16}$.", "4", "unique_id"),
    ("dapo.parquet", [{"role": "user", "content": "What is 2 + 2?"}], "4", "data_source"),
    ("gsm8k_saved", "Tom has 3 apples and buys 4 more. How many apples does he have?", "7", "question"),
  ],
)
def test_fixture_loads_with_detected_mapping(fname, prompt0, answer0, extra_col):
  ex = data.load_math_dataset(os.path.join(FIX, fname))
  assert ex[0].prompt == prompt0 and ex[0].answer == answer0
  assert extra_col in ex[0].columns


def test_gsm8k_answer_is_the_number_after_hashes():
  ex = data.load_math_dataset(os.path.join(FIX, "gsm8k_saved"), mapping="gsm8k")
  assert [e.answer for e in ex] == ["7", "2000"]
  with pytest.raises(ValueError, match="####"):
    data.gsm8k_final_answer("no marker 7")


def test_named_and_dict_mappings():
  a = data.load_math_dataset(os.path.join(FIX, "openrs.jsonl"), mapping="openrs")
  b = data.load_math_dataset(os.path.join(FIX, "openrs.jsonl"), mapping={"prompt": "problem", "answer": "level"})
  assert a[1].answer == "56" and b[1].answer == "Level 1"
  d = data.load_math_dataset(os.path.join(FIX, "dapo.parquet"), mapping="dapo", limit=1)
  assert len(d) == 1 and d[0].columns["reward_model"]["style"] == "rule-lighteval/MATH_v2"


def test_missing_column_lists_found_and_expected():
  with pytest.raises(ValueError) as e:
    data.load_math_dataset(os.path.join(FIX, "openrs.jsonl"), mapping={"prompt": "question", "answer": "answer"})
  msg = str(e.value)
  assert "question" in msg and "found" in msg and "problem" in msg and "level" in msg
  with pytest.raises(ValueError, match="found"):
    data.examples_from_rows([{"foo": 1, "bar": 2}])  # no built-in layout matches
  with pytest.raises(ValueError, match="mapping"):
    data.load_math_dataset(os.path.join(FIX, "openrs.jsonl"), mapping="nope")


def test_template_appends_instruction_and_generation_prompt(tok):
  ex = data.load_math_dataset(os.path.join(FIX, "openrs.jsonl"))
  enc = data.encode_prompts(tok, ex, max_prompt_tokens=512)
  expect = "<|user|>Compute $7 \\times 8$.\n\n" + data.INSTRUCTION + "<|end|><|assistant|>"
  assert enc.texts[1] == expect
  assert tok.decode(enc.tokens[1]) == expect
  chat = data.load_math_dataset(os.path.join(FIX, "dapo.parquet"))
  enc = data.encode_prompts(tok, chat, max_prompt_tokens=512)
  assert enc.texts[0] == "<|user|>What is 2 + 2?\n\n" + data.INSTRUCTION + "<|end|><|assistant|>"
  # an instruction already present is not repeated
  msgs = data.build_messages("Q\n\n" + data.INSTRUCTION)
  assert msgs[0]["content"].count(data.INSTRUCTION) == 1
  assert data.build_messages("Q", instruction=None) == [{"role": "user", "content": "Q"}]


def test_long_prompts_dropped_with_counted_warning_never_truncated(tok):
  ex = data.load_math_dataset(os.path.join(FIX, "gsm8k_saved"))
  lens = [len(t) for t in data.encode_prompts(tok, ex, max_prompt_tokens=10_000).tokens]
  limit = min(lens)  # the longer prompt is dropped, the shorter kept whole
  assert lens[0] != lens[1]
  with pytest.warns(UserWarning, match="dropped 1 of 2"):
    enc = data.encode_prompts(tok, ex, max_prompt_tokens=limit)
  assert enc.num_dropped == 1 and len(enc.tokens[0]) == limit
  assert enc.kept == [int(np.argmin(lens))]
  with pytest.raises(ValueError, match="every prompt"), pytest.warns(UserWarning):
    data.encode_prompts(tok, ex, max_prompt_tokens=3)


def test_pad_left():
  t, m = data.pad_left([[5, 6], [7]], 4, pad_id=0)
  np.testing.assert_array_equal(t, [[0, 0, 5, 6], [0, 0, 0, 7]])
  np.testing.assert_array_equal(m, [[0, 0, 1, 1], [0, 0, 0, 1]])
  with pytest.raises(ValueError, match="length"):
    data.pad_left([[1, 2, 3]], 2, pad_id=0)


def test_iterator_deterministic_epochs_and_exact_resume():
  it = data.PromptIterator(5, seed=3)
  first = np.concatenate([it.next(2) for _ in range(5)])  # two epochs
  assert sorted(first[:5]) == list(range(5)) and sorted(first[5:]) == list(range(5))
  assert not np.array_equal(first[:5], first[5:])  # reshuffled per epoch
  again = data.PromptIterator(5, seed=3)
  np.testing.assert_array_equal(np.concatenate([again.next(3), again.next(7)]), first)
  # resume from a saved position
  a = data.PromptIterator(7, seed=1)
  a.next(4)
  saved = a.state()
  rest = a.next(9)
  b = data.PromptIterator(7, seed=1).restore(saved)
  np.testing.assert_array_equal(b.next(9), rest)
  with pytest.raises(ValueError, match="seed"):
    data.PromptIterator(7, seed=2).restore(saved)


def test_host_slice_partitions_the_global_batch():
  batch = np.arange(8)
  parts = [data.host_slice(batch, p, 4) for p in range(4)]
  np.testing.assert_array_equal(np.concatenate(parts), batch)
  with pytest.raises(ValueError, match="divide"):
    data.host_slice(np.arange(6), 0, 4)
  with pytest.raises(ValueError, match="process_index"):
    data.host_slice(batch, 4, 4)


# ----------------------------------------------------------------------------- more formats
def test_json_array_and_csv_load_like_the_jsonl():
  a = data.load_math_dataset(os.path.join(FIX, "openrs_array.json"))
  b = data.load_math_dataset(os.path.join(FIX, "openrs.jsonl"))
  assert [(e.prompt, e.answer) for e in a] == [(e.prompt, e.answer) for e in b]
  c = data.load_math_dataset(os.path.join(FIX, "math500.csv"))
  assert [(e.prompt, e.answer) for e in c] == [
    ("Find $\\sqrt{16}$.", "4"),
    ("Simplify $\\frac{6}{8}$.", "\\frac{3}{4}"),
  ]
  assert c[0].columns["unique_id"] == "test/algebra/1.json"


# ----------------------------------------------------------------------------- rows without an answer
def test_rows_without_answer_are_skipped_with_a_warning_naming_them():
  path = os.path.join(FIX, "null_answers.jsonl")
  with pytest.warns(UserWarning, match=r"3 of 5 rows .* no answer .*rows 1, 2, 3") as w:
    ex = data.load_math_dataset(path)
  assert "null_answers.jsonl" in str(w[0].message)
  # a null answer never becomes the ground truth "None"; the integer 10 is kept as "10"
  assert [(e.prompt, e.answer) for e in ex] == [("What is 1 + 1?", "2"), ("What is 5 + 5?", "10")]
  with pytest.raises(ValueError, match=r"null_answers.jsonl.*rows 1, 2, 3"):
    data.load_math_dataset(path, missing_answers="raise")
  with pytest.raises(ValueError, match="missing_answers"):
    data.load_math_dataset(path, missing_answers="ignore")


def test_examples_from_rows_skips_none_nan_empty_answers():
  rows = [
    {"problem": "a", "answer": None},
    {"problem": "b", "answer": float("nan")},
    {"problem": "c", "answer": ""},
    {"problem": "d", "answer": "7"},
  ]
  with pytest.warns(UserWarning, match="3 of 4"):
    ex = data.examples_from_rows(rows)
  assert [e.answer for e in ex] == ["7"]
  assert all(e.answer != "None" for e in ex)
  with pytest.raises(ValueError, match="rows 0"):  # every row lacks an answer: nothing to train on
    data.examples_from_rows(rows[:1])
  # GSM8K: a null solution is skipped, not fed to the '####' parser
  with pytest.warns(UserWarning, match="1 of 2"):
    g = data.examples_from_rows([{"question": "q", "answer": None}, {"question": "r", "answer": "x #### 3"}], "gsm8k")
  assert [e.answer for e in g] == ["3"]
  with pytest.raises(ValueError, match=r"row 0: GSM8K answer has no '####'"):
    data.examples_from_rows([{"question": "q", "answer": "no marker"}], "gsm8k")


# ----------------------------------------------------------------------------- files that cannot be read
def _no_library_traceback(exc: BaseException) -> bool:
  return exc.__cause__ is None and (exc.__context__ is None or exc.__suppress_context__)


@pytest.mark.parametrize(
  "fname, match",
  [
    ("empty.jsonl", r"empty.jsonl is empty \(0 bytes\)"),
    ("empty.parquet", r"empty.parquet is empty \(0 bytes\)"),
    ("no_rows.parquet", r"no_rows.parquet has no rows"),
    ("garbage.parquet", r"cannot read .*garbage.parquet"),
    ("malformed.jsonl", r"malformed.jsonl line 3: malformed JSON"),
    ("not_a_dataset", r"not_a_dataset is a directory but neither a saved dataset .*notes.txt"),
    ("does_not_exist.jsonl", r"no such file or directory: .*does_not_exist.jsonl"),
    ("missing_dir/", r"no such file or directory: .*missing_dir"),
  ],
)
def test_unreadable_sources_are_one_clear_value_error(fname, match):
  with pytest.raises(ValueError, match=match) as e:
    data.load_math_dataset(os.path.join(FIX, fname))
  assert _no_library_traceback(e.value)


def test_malformed_lines_name_file_and_line(tmp_path):
  bad = tmp_path / "rows.jsonl"
  bad.write_text('{"problem": "a", "answer": "1"}\n[1, 2]\n')
  with pytest.raises(ValueError, match=r"rows.jsonl line 2: a row must be a JSON object; got list"):
    data.load_math_dataset(str(bad))
  bad.write_bytes(b'{"problem": "a", "answer": "1"}\n{"problem": "\xff"}\n')
  with pytest.raises(ValueError, match=r"rows.jsonl line 2: not UTF-8"):
    data.load_math_dataset(str(bad))
  arr = tmp_path / "rows.json"
  arr.write_text('[{"problem": "a", "answer": "1"},\n {"problem": "b" "answer": "2"}]')
  with pytest.raises(ValueError, match=r"rows.json: malformed JSON \(line 2"):
    data.load_math_dataset(str(arr))
  lines = tmp_path / "lines.json"  # a .json file may hold JSON lines too
  lines.write_text('{"problem": "a", "answer": "1"}\n{"problem": "b", "answer": "2"}\n{"problem": "c"\n')
  with pytest.raises(ValueError, match=r"lines.json line 3: malformed JSON"):
    data.load_math_dataset(str(lines))
  lines.write_text('{"problem": "a", "answer": "1"}\n{"problem": "b", "answer": "2"}\n')
  assert [e.answer for e in data.load_math_dataset(str(lines))] == ["1", "2"]
  arr.write_text('[{"problem": "a", "answer": "1"}, 3]')
  with pytest.raises(ValueError, match=r"rows.json: item 1 is a int; rows must be JSON objects"):
    data.load_math_dataset(str(arr))
  with pytest.raises(ValueError, match="limit"):
    data.load_math_dataset(str(lines), limit=0)
  blank = tmp_path / "blank.jsonl"
  blank.write_text("\n  \n")
  with pytest.raises(ValueError, match="blank.jsonl has no rows"):
    data.load_math_dataset(str(blank))
  other = tmp_path / "rows.txt"
  other.write_text("x")
  with pytest.raises(ValueError, match="unsupported file type 'txt'"):
    data.load_math_dataset(str(other))


def test_directories_of_data_files_and_broken_saved_datasets(tmp_path):
  files = tmp_path / "files"
  files.mkdir()
  (files / "train.jsonl").write_text(open(os.path.join(FIX, "openrs.jsonl")).read())
  assert [e.answer for e in data.load_math_dataset(str(files))] == ["\\frac{5}{6}", "56", "3"]
  broken = tmp_path / "broken_saved"
  broken.mkdir()
  (broken / "dataset_info.json").write_text("{}")
  with pytest.raises(ValueError, match=r"cannot load the saved dataset .*broken_saved") as e:
    data.load_math_dataset(str(broken))
  assert _no_library_traceback(e.value)
  empty = tmp_path / "empty_dir"
  empty.mkdir()
  with pytest.raises(ValueError, match=r"empty_dir is a directory .* it holds: nothing"):
    data.load_math_dataset(str(empty))
