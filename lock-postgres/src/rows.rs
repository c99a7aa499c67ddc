//! Reading the rows the statements return: typed columns, and the checks
//! that report a row distlock did not write as corrupted.

use distlock_core::{FencingToken, HeldLock, HolderId, LockError, LockKey};
use sqlx::postgres::PgRow;
use sqlx::Row;

use crate::backend::PostgresLock;
use crate::errors;
use crate::keys::is_owner_token;

impl PostgresLock {
    /// Reads column `name` of a row, reporting an unexpected type as corruption.
    pub(crate) fn column<'r, T>(&self, row: &'r PgRow, name: &str) -> Result<T, LockError>
    where
        T: sqlx::Decode<'r, sqlx::Postgres> + sqlx::Type<sqlx::Postgres>,
    {
        row.try_get(name)
            .map_err(|e| errors::map(e, "reading the lock row"))
    }

    /// Checks the row a lock call found for states distlock never writes.
    pub(crate) fn check_row(
        &self,
        owner: Option<&str>,
        fencing: Option<i64>,
        expected_fencing: Option<u64>,
    ) -> Result<(), LockError> {
        let table = self.qualified_table();
        let namespace = self.namespace();
        if let Some(owner) = owner {
            if !is_owner_token(owner) {
                return Err(LockError::corrupted(format!(
                    "the lock's row in namespace {namespace:?} of {table} has an owner distlock did not write; it is left untouched",
                )));
            }
        }
        match fencing {
            Some(f) if f < 0 => Err(LockError::corrupted(format!(
                "the lock's row in namespace {namespace:?} of {table} has a negative fencing counter ({f}); it is left untouched",
            ))),
            Some(f) if expected_fencing.is_some_and(|e| (f as u64) < e) => Err(LockError::corrupted(format!(
                "the lock's fencing counter in namespace {namespace:?} of {table} went backwards (row {f}, lease {}); the row was edited outside distlock",
                expected_fencing.unwrap_or_default()
            ))),
            _ => Ok(()),
        }
    }

    /// Reads the reply of extend or release (`done` rows changed, and the
    /// row as it was before the statement): whether `lock` held it, after
    /// checking the row for states distlock never writes.
    pub(crate) fn held_by(&self, lock: &HeldLock<'_>, row: &PgRow) -> Result<bool, LockError> {
        let done: i64 = self.column(row, "done")?;
        let owner: Option<String> = self.column(row, "owner")?;
        let fencing: Option<i64> = self.column(row, "fencing")?;
        self.held_as(lock, done, owner.as_deref(), fencing)
    }

    /// [`held_by`](Self::held_by) on the values of one lock's answer.
    pub(crate) fn held_as(
        &self,
        lock: &HeldLock<'_>,
        done: i64,
        owner: Option<&str>,
        fencing: Option<i64>,
    ) -> Result<bool, LockError> {
        let expected = lock.fencing.get();
        self.check_row(owner, fencing, Some(expected))?;
        if owner == Some(lock.owner.to_hex().as_str())
            && fencing.is_some_and(|f| f as u64 != expected)
        {
            return Err(LockError::corrupted(format!(
                "the lock's row in namespace {:?} of {} has this lease's owner with another fencing token; the row was edited outside distlock",
                self.namespace(),
                self.qualified_table()
            )));
        }
        Ok(done > 0)
    }

    /// The holder label stored in `key`'s row, refused as corruption if
    /// it is not one distlock writes (edited outside distlock).
    pub(crate) fn holder_label(&self, key: &LockKey, label: &str) -> Result<HolderId, LockError> {
        HolderId::new(label).map_err(|e| {
            LockError::corrupted(format!(
                "the row for lock {:?} in namespace {:?} of {} has a holder label distlock did not write ({e}); it is left untouched",
                key.as_str(),
                self.namespace(),
                self.qualified_table()
            ))
        })
    }

    /// The fencing token the acquire statement granted.
    pub(crate) fn granted(&self, fencing: Option<i64>) -> Result<FencingToken, LockError> {
        fencing
            .and_then(|f| u64::try_from(f).ok())
            .filter(|f| *f >= 1)
            .map(FencingToken::new)
            .ok_or_else(|| {
                LockError::corrupted(format!(
                    "the server granted an impossible fencing token {fencing:?}"
                ))
            })
    }

    /// Whether the row, as the release statement found it, was given up by
    /// `lock` (released by it) or freed with its fencing token
    /// (force-released since), and not taken by anyone after it.
    pub(crate) fn freed_with(&self, lock: &HeldLock<'_>, row: &PgRow) -> Result<bool, LockError> {
        let owner: Option<String> = self.column(row, "owner")?;
        let fencing: Option<i64> = self.column(row, "fencing")?;
        let given_up: bool = self.column(row, "given_up")?;
        let fencing = fencing.and_then(|f| u64::try_from(f).ok());
        let released = match owner {
            None => true,
            Some(owner) => given_up && owner == lock.owner.to_hex(),
        };
        Ok(released && fencing == Some(lock.fencing.get()))
    }
}
