"""experiments/prep_domain.py: the prose of reST documentation, without its code and markup."""

import prep_domain

DOC = """\
:mod:`spam` --- Eggs and spam
=============================

.. module:: spam
   :synopsis: Eggs.

The :func:`~spam.open` call opens a ``can`` of spam, see `the docs <https://x.org>`_ for more.
Use it like this::

   can = spam.open()
   can.close()

.. function:: open(mode='r')

   Return a new *can* object. It is **always** fresh [#]_.

   .. code-block:: python

      import spam
      spam.open()

   >>> spam.open()
   <can>

.. note::

   A note is prose and stays in the text.

.. toctree::
   spam/eggs.rst

+------+------+
| a    | b    |
+------+------+

* First item of a list of things.
* Second item of the same list here.

.. this is a comment
   over two lines
"""


def test_prose_keeps_sentences_and_drops_code_and_markup():
    got = prep_domain.document_sentences(DOC)
    assert got == [
        "spam -- Eggs and spam",
        "The open call opens a can of spam , see the docs for more .",
        "Use it like this :",
        "Return a new can object .",
        "It is always fresh .",
        "A note is prose and stays in the text .",
        "First item of a list of things .",
        "Second item of the same list here .",
    ]


def test_main_splits_by_document(tmp_path):
    root = tmp_path / "raw" / prep_domain.SOURCES
    root.mkdir(parents=True)
    for i in range(12):
        (root / f"doc{i:02d}.rst.txt").write_text(f"Document number {i} has one sentence in it.\n")
    assert prep_domain.main(["--raw", str(tmp_path / "raw"), "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out/heldout.txt").read_text() == "Document number 5 has one sentence in it .\n"
    train = (tmp_path / "out/train/pydoc.txt").read_text().splitlines()
    assert len(train) == 11 and "Document number 5 has one sentence in it ." not in train
