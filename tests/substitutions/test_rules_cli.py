"""`unity-pcg rules ...`: stats keys, verify of a rule file, generate at a tiny size, one-line errors."""
import json

from unity_pcg.substitutions import cache
from unity_pcg.substitutions.rule import dumps_rules
from unity_pcg.substitutions.terms import op, rule_of
from unity_pcg.cli import main


def test_stats_json_keys(capsys):
    assert main(["rules", "stats", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    for k in ("rules", "parallel_rules", "axioms", "candidates", "pruned", "proven", "unproven",
              "generate_seconds", "verify_seconds"):
        assert k in d, k
    assert d["rules"] == len(cache.load()) and d["parallel_rules"] > 0 and d["axioms"] > 0


def test_verify_a_rule_file(tmp_path, capsys):
    good = rule_of("relu_push", op("Relu", op("Partition", "x", dim="$d", degree="$k")),
                   op("Partition", op("Relu", "x"), dim="$d", degree="$k"), {"d": "dim", "k": "degree"})
    bad = rule_of("mm_comm", op("MatMul", "x", "y"), op("MatMul", "y", "x"))
    p = tmp_path / "r.json"
    p.write_text(dumps_rules([good]))
    assert main(["rules", "verify", str(p), "--timeout", "2", "--workers", "1"]) == 0
    p.write_text(dumps_rules([good, bad]))
    assert main(["rules", "verify", str(p), "--timeout", "1", "--workers", "1"]) == 1
    assert "NOT PROVEN mm_comm" in capsys.readouterr().out


def test_errors_are_one_line_exit_2(tmp_path, capsys):
    assert main(["rules", "verify", str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("unity-pcg rules: error:") and "\n" not in err
    bad = tmp_path / "bad.json"
    bad.write_text("{]")
    assert main(["rules", "verify", str(bad)]) == 2
    assert main(["rules", "generate", "--degrees", "x"]) == 2


def test_generate_small_set(tmp_path, capsys):
    out = tmp_path / "cache"
    assert main(["rules", "generate", "--max-ops", "1", "-o", str(out), "--quiet", "--workers", "1"]) == 0
    rs = cache.load(out)
    assert len(rs) >= 53          # the named templates at least, all proven
    assert rs.manifest["generator"]["max_ops"] == 1
    assert all(dict(r.proof)["status"] == "proven" for r in rs)
