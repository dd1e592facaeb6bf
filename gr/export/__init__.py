"""Sliced export of a trained model (docs/design.md §5): write, validate and read export directories.

``export_model``/``export_run`` (the writer) import the training code; everything else
(``check_export``, ``open_export``, ``load_hstu``) does not, so serving can import it.
Names load lazily for that reason.
"""

from gr.utils.lazy import lazy_getattr

_EXPORTS = {
    "export_model": "gr.export.writer",
    "export_run": "gr.export.writer",
    "check_export": "gr.export.reader",
    "open_export": "gr.export.reader",
    "load_hstu": "gr.export.reader",
    "read_hstu_config": "gr.export.reader",
    "ExportManifest": "gr.export.reader",
    "ExportError": "gr.export.format",
    "ExportFormatError": "gr.export.format",
    "Problem": "gr.export.format",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
