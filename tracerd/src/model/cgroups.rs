//! Per-cgroup series for the agent's metrics: (device, op, cgroup label) in the kernel's
//! bucket resolution, under a bound. Labels pass the config's include and exclude patterns;
//! the `top` busiest get their own series and the rest is folded into `other`, so that the
//! series of a device always add up to its IO. What is folded is counted by reason.

use std::{
    collections::HashMap,
    sync::Arc,
    time::{Duration, Instant},
};

use tracer_common::{IoRecord, SeriesAgg};

use crate::{
    model::op::Op,
    model::recorder::SeriesFrame,
    model::series::{KernelSeries, Series},
};

mod label;
pub use label::{LabelForm, Named};

/// The label of everything folded.
pub const OTHER: &str = "other";

/// Config `[cgroups]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CgroupLimits {
    pub label: LabelForm,
    /// Cgroup paths (globs: `*` any run of characters, `?` one) that may have series; all when
    /// empty.
    pub include: Vec<String>,
    /// Cgroup paths never given series (checked after `include`).
    pub exclude: Vec<String>,
    /// Labels with series of their own at most; the rest is `other`.
    pub top: usize,
    /// A label with no IO for this long loses its series (its cgroup went, or went quiet).
    pub expire_after: Duration,
}

impl Default for CgroupLimits {
    fn default() -> CgroupLimits {
        CgroupLimits {
            label: LabelForm::None,
            include: vec![],
            exclude: vec![],
            top: 20,
            expire_after: Duration::from_secs(300),
        }
    }
}

impl CgroupLimits {
    pub fn enabled(&self) -> bool {
        self.label != LabelForm::None
    }

    /// The label of a named cgroup, or why it has none.
    pub fn label_of(&self, named: &Named) -> Result<String, Unnamed> {
        match named {
            Named::Path(p) if self.admits(p) => Ok(self.label.label(p)),
            Named::Path(_) => Err(Unnamed::Excluded),
            Named::Gone | Named::Unknown => Err(Unnamed::Unknown),
        }
    }

    /// Whether the cgroup at `path` may have a series of its own.
    pub fn admits(&self, path: &str) -> bool {
        (self.include.is_empty() || self.include.iter().any(|p| glob(p, path)))
            && !self.exclude.iter().any(|p| glob(p, path))
    }
}

/// `*` matches any run of characters (slashes too), `?` one character.
pub fn glob(pattern: &str, text: &str) -> bool {
    let (p, t): (Vec<char>, Vec<char>) = (pattern.chars().collect(), text.chars().collect());
    // Iterative matching with one backtrack point: linear in practice, never exponential.
    let (mut pi, mut ti, mut star, mut mark) = (0, 0, None, 0);
    while ti < t.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == t[ti]) {
            pi += 1;
            ti += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some(pi);
            mark = ti;
            pi += 1;
        } else if let Some(s) = star {
            pi = s + 1;
            mark += 1;
            ti = mark;
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == '*')
}

/// IOs folded into `other`, by why.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Folded {
    /// The label was past the `top` limit.
    pub top: u64,
    /// The cgroup's path was not included, or excluded.
    pub excluded: u64,
    /// The cgroup went before it could be named, or no cgroup was known for the IO.
    pub unnamed: u64,
}

impl Folded {
    pub fn reasons(&self) -> [(&'static str, u64); 3] {
        [("top", self.top), ("excluded", self.excluded), ("unnamed", self.unnamed)]
    }
}

/// How each label is doing in the current ranking period.
#[derive(Debug)]
struct Label {
    key: Arc<str>,
    last_io: Instant,
    /// IOs this period (ranking).
    recent: u64,
}

/// A ranking period: labels are compared by their IOs in it.
pub const RANK_EVERY: Duration = Duration::from_secs(10);

/// The per-cgroup series and their bound.
#[derive(Debug)]
pub struct CgroupSeries {
    pub limits: CgroupLimits,
    /// Labels with series of their own.
    admitted: HashMap<Arc<str>, Label>,
    /// Labels folded for the bound, with their IOs this period: the busiest may take the place
    /// of an admitted label that did less. At most `4 * top` are remembered.
    waiting: HashMap<Arc<str>, u64>,
    pub series: HashMap<(u32, Op, Arc<str>), SeriesFrame>,
    pub folded: Folded,
    /// Labels that lost their series (expired, or displaced by a busier one).
    pub expired: u64,
    pub displaced: u64,
    /// Cgroup ids the agent holds names of (kept by the caller: it names them).
    pub names_cached: usize,
    period_start: Instant,
    other: Arc<str>,
}

/// Why an IO's cgroup has no label.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unnamed {
    Excluded,
    Unknown,
}

impl CgroupSeries {
    pub fn new(limits: CgroupLimits) -> CgroupSeries {
        CgroupSeries {
            limits,
            admitted: HashMap::new(),
            waiting: HashMap::new(),
            series: HashMap::new(),
            folded: Folded::default(),
            expired: 0,
            displaced: 0,
            names_cached: 0,
            period_start: Instant::now(),
            other: OTHER.into(),
        }
    }

    /// Labels with series now (`other` not counted).
    pub fn labels(&self) -> usize {
        self.admitted.len()
    }

    /// Adds one record of device `dev`, charged to `label` (Err: why it has none); returns
    /// the label it was counted under.
    pub fn add(
        &mut self,
        dev: u32,
        op: Op,
        rec: &IoRecord,
        label: Result<&str, Unnamed>,
        now: Instant,
    ) -> Arc<str> {
        let to = self.count_under(label, 1, now);
        self.series.entry((dev, op, to.clone())).or_default().add_record(rec, &[]);
        to
    }

    /// Adds what the kernel counted in one (cgroup, device, op) series since the last fold,
    /// charged to `label`, as that many records would be; returns the label it was counted
    /// under.
    pub fn add_kernel(
        &mut self,
        dev: u32,
        op: Op,
        counted: &SeriesAgg,
        label: Result<&str, Unnamed>,
        now: Instant,
    ) -> Arc<str> {
        let to = self.count_under(label, counted.requests, now);
        self.series.entry((dev, op, to.clone())).or_default().add_kernel(counted);
        to
    }

    /// The series `n` IOs charged to `label` are counted under, with the ranking and the
    /// folding counters updated.
    fn count_under(&mut self, label: Result<&str, Unnamed>, n: u64, now: Instant) -> Arc<str> {
        match label {
            Err(Unnamed::Excluded) => {
                self.folded.excluded += n;
                self.other.clone()
            }
            Err(Unnamed::Unknown) => {
                self.folded.unnamed += n;
                self.other.clone()
            }
            Ok(l) => self.admit(l, n, now),
        }
    }

    /// The series an IO charged to `label` is counted under now, counting nothing: an IO the
    /// kernel counted names its series with it (exemplars).
    pub fn counted_under(&self, label: Result<&str, Unnamed>) -> Arc<str> {
        match label {
            Ok(l) => self.admitted.get(l).map_or_else(|| self.other.clone(), |l| l.key.clone()),
            Err(_) => self.other.clone(),
        }
    }

    /// The series label for `n` IOs of `label`: itself if it has (or now gets) one, else
    /// `other`.
    fn admit(&mut self, label: &str, n: u64, now: Instant) -> Arc<str> {
        if let Some(l) = self.admitted.get_mut(label) {
            l.last_io = now;
            l.recent += n;
            return l.key.clone();
        }
        if self.admitted.len() < self.limits.top && label != OTHER {
            let k: Arc<str> = label.into();
            self.waiting.remove(label);
            self.admitted.insert(k.clone(), Label { key: k.clone(), last_io: now, recent: n });
            return k;
        }
        self.folded.top += n;
        if let Some(w) = self.waiting.get_mut(label) {
            *w += n;
        } else if self.waiting.len() < 4 * self.limits.top.max(1) {
            self.waiting.insert(label.into(), n);
        }
        self.other.clone()
    }

    /// Housekeeping: labels idle past the expiry lose their series; at the end of a ranking
    /// period, the busiest waiting labels take the places of admitted ones that did less.
    /// A series that goes ends (its counters never go back); one that comes starts at zero.
    pub fn tick(&mut self, now: Instant) {
        let expire = self.limits.expire_after;
        let idle: Vec<Arc<str>> = self
            .admitted
            .iter()
            .filter(|(_, l)| now.duration_since(l.last_io) >= expire)
            .map(|(k, _)| k.clone())
            .collect();
        for k in idle {
            self.drop_label(&k);
            self.expired += 1;
        }
        if now.duration_since(self.period_start) < RANK_EVERY {
            return;
        }
        self.period_start = now;
        let mut waiting: Vec<(Arc<str>, u64)> = self.waiting.drain().collect();
        waiting.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        for (label, n) in waiting {
            if self.admitted.len() < self.limits.top {
                self.admitted.insert(label.clone(), Label { key: label, last_io: now, recent: 0 });
                continue;
            }
            let Some((quietest, q)) = self
                .admitted
                .iter()
                .map(|(k, l)| (k.clone(), l.recent))
                .min_by(|a, b| a.1.cmp(&b.1).then_with(|| b.0.cmp(&a.0)))
            else {
                break;
            };
            // A clear margin, so that two labels of equal rate do not swap every period.
            if n <= 2 * q + 10 {
                break;
            }
            self.drop_label(&quietest);
            self.displaced += 1;
            self.admitted.insert(label.clone(), Label { key: label, last_io: now, recent: 0 });
        }
        for l in self.admitted.values_mut() {
            l.recent = 0;
        }
    }

    fn drop_label(&mut self, label: &Arc<str>) {
        self.admitted.remove(label);
        self.series.retain(|(_, _, l), _| l != label);
    }

    /// Series sorted by device, op and label.
    pub fn sorted<'a>(
        &'a self,
        name: impl Fn(u32) -> &'a str,
    ) -> Vec<(&'a str, Op, &'a str, &'a SeriesFrame)> {
        let mut v: Vec<_> = self.series.iter().map(|((d, op, l), s)| (name(*d), *op, &**l, s)).collect();
        v.sort_by(|a, b| (a.0, a.1, a.2).cmp(&(b.0, b.1, b.2)));
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracer_common::{event, kind};

    fn io() -> IoRecord {
        let mut r = IoRecord { kind: kind::REQUEST, bytes: 4096, ..Default::default() };
        (r.ts[event::Q], r.ts[event::D], r.ts[event::C]) = (1000, 2000, 9000);
        r
    }

    fn limits(top: usize) -> CgroupLimits {
        CgroupLimits { label: LabelForm::Path, top, ..Default::default() }
    }

    fn requests(s: &CgroupSeries, label: &str) -> u64 {
        s.series.iter().filter(|((_, _, l), _)| &**l == label).map(|(_, f)| f.requests).sum()
    }

    #[test]
    fn globs_match_paths() {
        assert!(glob("/system.slice/*", "/system.slice/nginx.service"));
        assert!(glob("*nginx*", "/system.slice/nginx.service"));
        assert!(glob("/kubepods/*/pod?*", "/kubepods/burstable/pod1234"));
        assert!(!glob("/system.slice/*", "/user.slice/x"));
        assert!(glob("*", "/"));
        assert!(!glob("/a", "/ab"));
        assert!(glob("/a*b*c", "/axxbyyc") && !glob("/a*b*c", "/axxbyy"));
        let l =
            CgroupLimits { include: vec!["/work/*".into()], exclude: vec!["*/noisy".into()], ..limits(5) };
        assert!(l.admits("/work/a") && !l.admits("/work/noisy") && !l.admits("/other"));
    }

    #[test]
    fn past_the_bound_ios_fold_into_other_and_are_counted() {
        let mut s = CgroupSeries::new(limits(2));
        let now = Instant::now();
        for label in ["/a", "/b", "/c", "/a", "/d"] {
            s.add(1, Op::Read, &io(), Ok(label), now);
        }
        s.add(1, Op::Read, &io(), Err(Unnamed::Excluded), now);
        s.add(1, Op::Write, &io(), Err(Unnamed::Unknown), now);
        assert_eq!((requests(&s, "/a"), requests(&s, "/b"), requests(&s, OTHER)), (2, 1, 4));
        assert_eq!(s.folded, Folded { top: 2, excluded: 1, unnamed: 1 });
        assert_eq!(s.labels(), 2);
        let total: u64 = s.series.values().map(|f| f.requests).sum();
        assert_eq!(total, 7, "the series add up to every IO");
    }

    #[test]
    fn idle_labels_expire_and_busier_ones_displace_the_quietest() {
        let mut s = CgroupSeries::new(CgroupLimits { expire_after: Duration::from_secs(60), ..limits(2) });
        let t0 = Instant::now();
        s.add(1, Op::Read, &io(), Ok("/quiet"), t0);
        s.add(1, Op::Read, &io(), Ok("/busy"), t0);
        for _ in 0..100 {
            s.add(1, Op::Read, &io(), Ok("/busy"), t0);
            s.add(1, Op::Read, &io(), Ok("/new"), t0);
        }
        assert_eq!(requests(&s, "/new"), 0, "no room yet: folded");
        s.tick(t0 + RANK_EVERY);
        assert_eq!((s.displaced, s.labels()), (1, 2));
        s.add(1, Op::Read, &io(), Ok("/new"), t0 + RANK_EVERY);
        assert_eq!(requests(&s, "/new"), 1, "it has a series now, from zero");
        assert_eq!(requests(&s, "/quiet"), 0, "the quietest one's series ended");
        s.tick(t0 + Duration::from_secs(100));
        assert_eq!((s.labels(), s.expired), (0, 2), "both idle past the expiry");
        assert!(s.series.keys().all(|(_, _, l)| &**l == OTHER));
    }

    #[test]
    fn kernel_counts_rank_and_fold_as_their_records_would() {
        let mut by_records = CgroupSeries::new(limits(1));
        let mut by_kernel = CgroupSeries::new(limits(1));
        let now = Instant::now();
        let mut counted = SeriesAgg::default();
        (counted.requests, counted.bytes) = (3, 3 * 4096);
        for label in [Ok("/a"), Ok("/b"), Err(Unnamed::Excluded)] {
            for _ in 0..3 {
                by_records.add(1, Op::Read, &io(), label, now);
            }
            by_kernel.add_kernel(1, Op::Read, &counted, label, now);
        }
        assert_eq!((requests(&by_kernel, "/a"), requests(&by_kernel, OTHER)), (3, 6));
        assert_eq!(by_kernel.folded, by_records.folded);
        assert_eq!(by_kernel.folded, Folded { top: 3, excluded: 3, unnamed: 0 });
        // A slow IO the kernel counted names the series it went to, counting nothing.
        assert_eq!(&*by_kernel.counted_under(Ok("/a")), "/a");
        assert_eq!(&*by_kernel.counted_under(Ok("/b")), OTHER);
        assert_eq!(&*by_kernel.counted_under(Err(Unnamed::Unknown)), OTHER);
        assert_eq!(requests(&by_kernel, "/a") + requests(&by_kernel, OTHER), 9);
    }

    #[test]
    fn waiting_labels_are_bounded() {
        let mut s = CgroupSeries::new(limits(1));
        let now = Instant::now();
        for i in 0..1000 {
            s.add(1, Op::Read, &io(), Ok(&format!("/c{i}")), now);
        }
        assert!(s.waiting.len() <= 4);
        assert_eq!(s.series.len(), 2, "one label and other");
    }
}
