//! llora end-to-end test package.
