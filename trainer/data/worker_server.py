"""Imported first by the fork server of the stream tokenizer workers (trainer.data.stream_lanes),
and only there.

multiprocessing starts each worker by running the program's main module again. The server has
already imported that module (so that the workers find every import done), and running an
imported module again makes `runpy` warn that it was "found in sys.modules". Here that is
intended: the workers only tokenize and use nothing of the main module, so the warning is
silenced in the server and the workers forked from it, not in the trainer.
"""

import warnings

warnings.filterwarnings("ignore", message=r"'.*' found in sys.modules after import of package", category=RuntimeWarning)
