"""Work a reply does not wait for: run in order, after the reply, and never lost or fatal."""

from __future__ import annotations

import logging

from kvserver.service.after_reply import AfterReply


def test_work_runs_in_order_including_work_queued_while_running():
    after, seen = AfterReply(), []
    after.defer(lambda: seen.append(1))
    after.defer(lambda: (seen.append(2), after.defer(lambda: seen.append(4))))
    after.defer(lambda: seen.append(3))
    assert len(after) == 3 and seen == []
    after.run()
    assert seen == [1, 2, 3, 4] and len(after) == 0


def test_a_failing_item_is_logged_and_the_rest_still_run(caplog):
    after, seen = AfterReply(), []
    after.defer(lambda: 1 / 0)
    after.defer(lambda: seen.append("after"))
    with caplog.at_level(logging.ERROR, logger="kvserver"):
        after.run()
    assert seen == ["after"]
    assert "deferred work of an answered request failed" in caplog.text
