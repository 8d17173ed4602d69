"""The one way the scripts rewrite a generated section of a page, on strings written out by hand."""
import pytest

from megatron.benchmarking.doc_sections import MissingSection, replace_section


def test_replaces_only_between_the_first_pair_and_keeps_the_markers():
    page = "intro\n<!-- a -->\nold\n<!-- /a -->\nmiddle <!-- /a -->\n<!-- a -->\nsecond\n<!-- /a -->\n"
    assert replace_section(page, "<!-- a -->\n", "<!-- /a -->", "new\n") == (
        "intro\n<!-- a -->\nnew\n<!-- /a -->\nmiddle <!-- /a -->\n<!-- a -->\nsecond\n<!-- /a -->\n")


def test_an_end_before_the_begin_does_not_count():
    assert replace_section("<!-- /a --> x <!-- a -->y<!-- /a -->", "<!-- a -->", "<!-- /a -->", "z") == (
        "<!-- /a --> x <!-- a -->z<!-- /a -->")


@pytest.mark.parametrize("page", ["no markers", "<!-- a --> begin only", "<!-- /a --> end only <!-- a -->"])
def test_a_page_without_the_pair_is_an_error(page):
    with pytest.raises(MissingSection, match="no <!-- a --> ... <!-- /a --> section"):
        replace_section(page, "<!-- a -->", "<!-- /a -->", "x")
