"""`configurable_fields` for Kev models: per-input settings, still one packed pass per batch.

LangChain's `RunnableConfigurableFields.batch` runs one `invoke` per input in a thread pool
as soon as the inputs' settings differ. Kev's version builds every input's model (the same
cheap copies LangChain would build) and runs their invokes through `coalesce.batch`, so
all their requests share one packed pass.
"""

from __future__ import annotations

from typing import Any, cast

from langchain_core.runnables import RunnableConfig
from langchain_core.runnables.config import get_config_list
from langchain_core.runnables.configurable import RunnableConfigurableFields

from . import coalesce


class KevConfigurableFields(RunnableConfigurableFields):
    """A Kev model with fields settable per call from ``config["configurable"]``.

    .. code-block:: python

        flexible = ChatKev().configurable_fields(adapter=ConfigurableField(id="adapter"))
        flexible.batch(inputs, config=[{"configurable": {"adapter": "a"}}, {"configurable": {"adapter": "b"}}])
        # → one packed engine pass answering both, each with its own adapter
    """

    def batch(
        self,
        inputs: list[Any],
        config: RunnableConfig | list[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> list[Any]:
        configs = get_config_list(config, len(inputs))
        prepared = [self.prepare(c) for c in configs]
        models = [cast(coalesce.BatchModel, model) for model, _ in prepared]
        return coalesce.batch(models, inputs, [c for _, c in prepared], return_exceptions, kwargs)

    async def abatch(
        self,
        inputs: list[Any],
        config: RunnableConfig | list[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> list[Any]:
        configs = get_config_list(config, len(inputs))
        prepared = [self.prepare(c) for c in configs]
        models = [cast(coalesce.BatchModel, model) for model, _ in prepared]
        return await coalesce.abatch(models, inputs, [c for _, c in prepared], return_exceptions, kwargs)
