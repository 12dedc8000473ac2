"""``reward.sources`` of the trainer config (jaxgrpo.run.spec_schema.RewardSourceSpec, assemble.build_rewards):
the YAML form round-trips, bad entries are named, and the built RewardSet mixes a reward model (a tiny random
classifier checked against transformers) and a remote service (a real local HTTP server) by weight, with each
source's values and counters reported."""

from __future__ import annotations

import http.server
import json
import threading

import numpy as np
import pytest
from test_reward_models import hf_scores, make_classifier

from jaxgrpo.run import assemble
from jaxgrpo.run.specs import config_from_dict

torch = pytest.importorskip("torch")


class Handler(http.server.BaseHTTPRequestHandler):
  def log_message(self, *args):
    pass

  def do_POST(self):
    payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
    scores = [len(c) / 10 if i % 2 == 0 else None for i, c in enumerate(payload["completions"])]
    body = json.dumps({"scores": scores}).encode()
    self.send_response(200)
    self.send_header("Content-Length", str(len(body)))
    self.end_headers()
    self.wfile.write(body)


def test_sources_round_trip_and_are_checked():
  d = {"reward": {"sources": [{"name": "svc", "kind": "remote", "url": "http://127.0.0.1:9/x", "weight": 0.5}]}}
  cfg = config_from_dict(d)
  assert cfg.reward.sources[0].weight == 0.5 and cfg.reward.sources[0].retries == 2
  assert config_from_dict(cfg.to_dict()) == cfg
  bad = [
    ({"name": "svc", "kind": "remote"}, r"`reward.sources\['svc'\].url` is required"),
    ({"name": "rm", "kind": "reward_model"}, r"\.path` is required"),
    ({"name": "x", "kind": "oracle", "url": "http://a"}, r"`reward.sources\['x'\].kind` must be one of"),
    ({"name": "accuracy", "kind": "remote", "url": "http://a"}, "other than"),
    ({"name": "x", "kind": "remote", "url": "http://a", "deadline_s": 0}, "deadline_s` must be > 0"),
  ]
  for entry, match in bad:
    with pytest.raises(ValueError, match=match):
      config_from_dict({"reward": {"sources": [entry]}})
  with pytest.raises(ValueError, match="must be distinct"):
    config_from_dict({"reward": {"sources": [d["reward"]["sources"][0]] * 2}})


def test_build_rewards_mixes_a_reward_model_and_a_service_by_weight(tmp_path):
  from jaxgrpo.tasks.arithmetic import build_tokenizer

  tok = build_tokenizer()
  path, hf = make_classifier(tmp_path / "rm", "qwen2", tied=False, vocab_size=len(tok))
  hf.config.pad_token_id = tok.pad_token_id
  hf.save_pretrained(path)
  tok.save_pretrained(path)
  srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
  threading.Thread(target=srv.serve_forever, daemon=True).start()
  try:
    cfg = config_from_dict(
      {
        "reward": {
          "weights": {"format": 1.0},
          "timeout_s": None,
          "sources": [
            {"name": "rm", "kind": "reward_model", "path": path, "weight": 0.5, "batch_size": 4},
            {"name": "svc", "kind": "remote", "url": f"http://127.0.0.1:{srv.server_address[1]}/", "weight": 2.0},
          ],
        }
      }
    )
    _, reward_set = assemble.build_rewards(cfg)
    prompts, completions = ["What is 1 + 1?", "What is 2 + 2?"], ["\\boxed{2}", "4"]
    res = reward_set(prompts, completions, {"answer": ["2", "4"]})
  finally:
    srv.shutdown()
    srv.server_close()
  rm = reward_set.fns[1][1]
  want_rm = [
    float(hf_scores(hf, np.asarray([rm.encode(p, c)]), np.ones((1, len(rm.encode(p, c))), bool))[0, 0])
    for p, c in zip(prompts, completions)
  ]
  np.testing.assert_allclose(res.per_fn["rm"], want_rm, atol=1e-4)
  assert res.per_fn["format"].tolist() == [1.0, 0.0]
  assert res.per_fn["svc"][0] == pytest.approx(len(completions[0]) / 10) and np.isnan(res.per_fn["svc"][1])
  assert res.total[0] == pytest.approx(1.0 + 0.5 * want_rm[0] + 2.0 * len(completions[0]) / 10, rel=1e-5)
  assert np.isnan(res.total[1])  # the service's missing row is missing in the sum
  assert res.counters == {"svc/requests": 1, "svc/null_scores": 1, "svc/missing": 1}
