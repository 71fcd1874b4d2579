"""The faces keep the old imports working after the house moved (issue 43 item 3): featdiff.dump's
records, `from featdiff import kinds`, featdiff.verdict's result, the API and the pytest plugin."""

from __future__ import annotations


def test_the_dump_face_gives_the_records_and_the_reader():
    from featdiff import dump
    from featdiff.dump import manifest, reader, records, writer

    homes = {"Eval": records, "Record": records, "Round": records, "Manifest": manifest}
    for name, home in {**homes, "DumpWriter": writer, "read_dump": reader}.items():
        assert getattr(dump, name) is getattr(home, name), name


def test_the_kinds_face_gives_the_registry_and_the_wiring_that_moved_out_of_it():
    from featdiff import kinds
    from featdiff.kinds import eagle3, mtp, registry

    assert kinds.KINDS is registry.KINDS and kinds.by_name("eagle3") is registry.by_name("eagle3")
    assert kinds.EAGLE3_WIRING is eagle3.EAGLE3_WIRING
    assert (kinds.MTP, kinds.MTP_WIRING) == (mtp.MTP, mtp.MTP_WIRING)


def test_the_verdict_face_gives_the_result():
    from featdiff import verdict
    from featdiff.verdict import plan, render, result, run

    assert verdict.CheckResult is result.CheckResult
    assert (verdict.plan_check, verdict.check, verdict.render_text) == (plan.plan_check, run.check, render.render_text)


def test_the_api_and_the_plugin_stay_where_they_were():
    import featdiff
    from featdiff import api, pytest_plugin

    assert featdiff.check is api.check and featdiff.compare is api.compare
    assert pytest_plugin.__name__ == "featdiff.pytest_plugin"
