"""MkDocs hook: the pages generated from the code, so that they cannot drift from it.

reference/api.md is written whole from rlhf_api.reference; the Troubleshooting page's
`<!-- status-reasons -->` becomes the table of rlhf_operator.reasons.
"""

from __future__ import annotations

from mkdocs.structure.files import File

from rlhf_api import reference
from rlhf_operator import reasons

API_PAGE = "reference/api.md"
REASONS_MARK = "<!-- status-reasons -->"


def reasons_table() -> str:
    rows = ["| reason | phase | what it means | what to do |", "|---|---|---|---|"]
    rows += [f"| `{reason}` | {phase} | {meaning} | {action} |"
             for reason, (phase, meaning, action) in reasons.REASONS.items()]
    rows += [f"| `{reason}` | {phase} | {meaning} | {action} |"
             for reason, (phase, meaning, action) in reasons.FROM_THE_TRAINER.items()]
    rows += ["", "While the Ray cluster starts, queues or fails, the reason may be another component's:", "",
             "| reason | from |", "|---|---|"]
    rows += [f"| `{reason}` | {source} |" for reason, source in reasons.PASSED_ON.items()]
    return "\n".join(rows)


def on_files(files, config):
    files.append(File.generated(config, API_PAGE, content=reference.markdown()))
    return files


def on_page_markdown(markdown, page, config, files):
    return markdown.replace(REASONS_MARK, reasons_table())
