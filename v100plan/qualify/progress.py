"""One line per acceptance case on stderr, a spinner while it runs (accept and qualify print it)."""

from __future__ import annotations

from typing import Any

from v100plan import output


class Progress:
    """The acceptance runner's progress callback: `note`, `case_start` and `case_end` events."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.bar_cm = output.progress(enabled=enabled)
        self.bar = None
        self.task = None
        self.n = 0

    def __enter__(self):
        self.bar = self.bar_cm.__enter__()
        return self

    def __exit__(self, *exc):
        return self.bar_cm.__exit__(*exc)

    def __call__(self, event: str, fields: dict[str, Any]) -> None:
        if event == "note":
            self.bar.console.print(f"  {fields['text']}", markup=False)
        elif event == "case_start":
            self.n += 1
            self.task = self.bar.add_task(f"{fields['group']:<10} {fields['key']}", total=1)
        elif event == "case_end":
            dur = f"{fields['duration_s']:.1f} s" if fields.get("duration_s") is not None else ""
            line = f"{fields['group']:<10} {fields['key']:<18} {fields['status']:<7} {dur}"
            if fields["status"] != "passed" and fields.get("reason"):
                line += f"  {fields['reason'][:150]}"
            if self.task is not None:
                self.bar.remove_task(self.task)
                self.task = None
            self.bar.console.print(line, markup=False)
