//! Thread-local settings that hold for a scope: a block's context-parallel split for dropout,
//! the generic attention of a numerics check, a test's CUDA routes on the CPU, the group FP8
//! amaxes are reduced over. One guard puts the earlier value back when the scope ends, also
//! when it unwinds, so settings nest.

use std::cell::{Cell, RefCell};
use std::thread::LocalKey;

/// Puts the value a thread-local `Cell` held before [`set`] back when dropped.
#[must_use = "the setting ends when this is dropped"]
pub struct Restore<T: Copy + 'static> {
    key: &'static LocalKey<Cell<T>>,
    earlier: T,
}

impl<T: Copy + 'static> Drop for Restore<T> {
    fn drop(&mut self) {
        self.key.with(|c| c.set(self.earlier));
    }
}

/// Sets this thread's `key` to `value` until the returned guard is dropped.
pub fn set<T: Copy + 'static>(key: &'static LocalKey<Cell<T>>, value: T) -> Restore<T> {
    Restore { key, earlier: key.with(|c| c.replace(value)) }
}

/// Runs `f` with this thread's `key` set to `value`; nothing is borrowed while `f` runs.
pub fn with<T: Copy + 'static, R>(key: &'static LocalKey<Cell<T>>, value: T, f: impl FnOnce() -> R) -> R {
    let _restore = set(key, value);
    f()
}

/// Puts the value a thread-local `RefCell` held before [`with_value`] back when dropped.
struct RestoreValue<T: 'static> {
    key: &'static LocalKey<RefCell<T>>,
    earlier: Option<T>,
}

impl<T: 'static> Drop for RestoreValue<T> {
    fn drop(&mut self) {
        if let Some(earlier) = self.earlier.take() {
            self.key.with(|c| *c.borrow_mut() = earlier);
        }
    }
}

/// [`with`] for a value that is not `Copy` (an `Arc`), kept in a `RefCell`: nothing is
/// borrowed while `f` runs, so `f` may read the setting or set it again.
pub fn with_value<T: 'static, R>(key: &'static LocalKey<RefCell<T>>, value: T, f: impl FnOnce() -> R) -> R {
    let _restore = RestoreValue { key, earlier: Some(key.with(|c| c.replace(value))) };
    f()
}

#[cfg(test)]
mod tests {
    use super::*;

    thread_local! {
        static X: Cell<u8> = const { Cell::new(0) };
    }

    /// Nested scopes restore the enclosing value, a panic inside restores too, and another
    /// thread never sees the setting.
    #[test]
    fn settings_nest_unwind_and_stay_on_their_thread() {
        with(&X, 1, || {
            with(&X, 2, || assert_eq!(X.with(Cell::get), 2));
            assert_eq!(X.with(Cell::get), 1);
            assert_eq!(std::thread::spawn(|| X.with(Cell::get)).join().unwrap(), 0);
        });
        assert_eq!(X.with(Cell::get), 0);
        assert!(std::panic::catch_unwind(|| with(&X, 3, || panic!("x"))).is_err());
        assert_eq!(X.with(Cell::get), 0);
    }

    thread_local! {
        static V: RefCell<Option<String>> = const { RefCell::new(None) };
    }

    /// The same for a value kept in a `RefCell`.
    #[test]
    fn values_nest_and_unwind_too() {
        let get = || V.with(|v| v.borrow().clone());
        with_value(&V, Some("a".to_string()), || {
            with_value(&V, None, || assert_eq!(get(), None));
            assert_eq!(get().as_deref(), Some("a"));
        });
        assert_eq!(get(), None);
        assert!(std::panic::catch_unwind(|| with_value(&V, Some("b".into()), || panic!("x"))).is_err());
        assert_eq!(get(), None);
    }
}
