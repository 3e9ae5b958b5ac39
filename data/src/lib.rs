//! GovReport data pipeline for llora (issue #4): readers, tokenizer path, synthetic set, loaders.
