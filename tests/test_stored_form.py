"""`StoredForm`: the pages a quantized mix keeps its tokens in."""

from __future__ import annotations

import pytest

from kvwise.kv.quantizer import make_quantizer
from kvwise.kv.stored_form import PER_TOKEN_PAGE, StoredForm

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("name", "page"),
    [("kivi2", 32), ("kivi4:group_size=16:residual_length=32", 16), ("int8", PER_TOKEN_PAGE), ("fp8", PER_TOKEN_PAGE)],
)
def test_a_page_is_a_key_group_or_the_per_token_page(name, page):
    assert StoredForm.of(make_quantizer(name)).page_tokens() == page
