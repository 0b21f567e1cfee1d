"""Checks every link between the pages of a built HTML site: each relative ``href`` or
``src`` must name a file of the site and, with ``#fragment``, an element with that id.

    python docs/check_links.py build/docs/html

Links with a scheme (``https:``, ``mailto:``) are not followed: the check needs no network.
Exits 1, listing each broken link with the page it is on.
"""

from __future__ import annotations

import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit


class _Page(HTMLParser):
    """The links and the ids of one HTML page."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.links: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if value is None:
                continue
            if name in ("href", "src"):
                self.links.append(value)
            elif name in ("id", "name"):
                self.ids.add(value)


def _parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


def broken_links(site: Path) -> list[str]:
    """Each broken link as ``page: link (why)``."""
    pages = {path.resolve(): _parse(path) for path in site.rglob("*.html")}
    broken = []
    for path, page in sorted(pages.items()):
        for link in page.links:
            parts = urlsplit(link)
            if parts.scheme or parts.netloc:
                continue
            target = (path.parent / unquote(parts.path)).resolve() if parts.path else path
            where = f"{path.relative_to(site.resolve())}: {link}"
            if not target.is_file():
                broken.append(f"{where} (no such file)")
            elif parts.fragment and target.suffix == ".html":
                if unquote(parts.fragment) not in pages[target].ids:
                    broken.append(f"{where} (no such anchor)")
    return broken


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print("usage: python docs/check_links.py BUILT_HTML_DIR", file=sys.stderr)
        return 2
    broken = broken_links(Path(argv[0]))
    for line in broken:
        print(f"broken link: {line}", file=sys.stderr)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
