"""SamplingParams and StructuredOutput under their first path: serving.params (the request contract) owns them; many
tests import them from here."""
from serving.params import (MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_N, SamplingParams,  # noqa: F401 - re-exported
                            StructuredOutput, stop_token_set)
