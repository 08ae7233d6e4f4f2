//! A plan in words for the CLI: enough to see why Auto chose what it did
//! and where the collectives sit relative to the GEMM.

use std::fmt;

use super::{GemmAllReducePlan, Schedule};
use crate::plan::groups::Partition;

const TIMELINE_COLUMNS: usize = 60;

impl GemmAllReducePlan {
    /// Human-readable multi-line summary: shape, tiles, ctas and waves,
    /// schedule, each group's extent and predicted times, overall prediction,
    /// and an ASCII timeline of the GEMM and the collectives.
    pub fn describe(&self) -> String {
        self.to_string()
    }
}

impl fmt::Display for GemmAllReducePlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (req, tiles, t) = (&self.request, &self.tiles, &self.timeline);
        writeln!(
            f,
            "out[{m} x {n}] = x[{m} x {k}] @ w[{n} x {k}]^T, {b}-byte elements, AllReduce over {w} ranks",
            m = req.m,
            n = req.n,
            k = req.k,
            b = req.elem_bytes,
            w = req.world
        )?;
        writeln!(
            f,
            "tiles: {}x{}x{} -> {} x {} = {} tiles, {:?} order",
            tiles.tile.bm,
            tiles.tile.bn,
            tiles.tile.bk,
            tiles.tiles_m,
            tiles.tiles_n,
            tiles.count(),
            self.order.kind
        )?;
        let beside = match self.schedule {
            Schedule::Overlap => format!(", {} SMs left to the collective", req.reserved_sms),
            Schedule::Sequential => String::new(),
        };
        writeln!(
            f,
            "ctas: {}{beside} -> {} waves",
            self.ctas,
            self.waves.count()
        )?;
        let schedule = match self.schedule {
            Schedule::Overlap => "overlap",
            Schedule::Sequential => "sequential",
        };
        writeln!(f, "schedule: {schedule}, {} group(s)", self.partition.len())?;
        writeln!(
            f,
            "{:>5}  {:<11} {:<13} {:>7} {:<9} {:>11} {:>11} {:>10} {:>10} {:>10}",
            "group",
            "bands",
            "rows",
            "tiles",
            "waves",
            "offset",
            "count",
            "gemm done",
            "comm start",
            "comm end"
        )?;
        let span = |r: &std::ops::Range<u32>| format!("{}..{}", r.start, r.end);
        // In place: the group's row bands and output rows; staged: its
        // positions, scattered over `out` and contiguous in the staging buffer.
        let extents: Vec<(String, String)> = match &self.partition {
            Partition::InPlace(p) => p
                .groups
                .iter()
                .map(|g| (span(&g.bands), span(&g.rows)))
                .collect(),
            Partition::Staged(p) => p
                .groups
                .iter()
                .map(|g| ("staged".into(), format!("pos {}", span(&g.positions))))
                .collect(),
        };
        let collectives = self.partition.collectives();
        for (g, ((group, timing), (bands, rows))) in
            collectives.iter().zip(&t.groups).zip(extents).enumerate()
        {
            let waves = format!(
                "{}-{}",
                self.waves.wave_of(group.positions.start),
                self.waves.wave_of(group.positions.end - 1)
            );
            writeln!(
                f,
                "{g:>5}  {:<11} {:<13} {:>7} {:<9} {:>11} {:>11} {:>10.1} {:>10.1} {:>10.1}",
                bands,
                rows,
                group.tiles,
                waves,
                group.slice.offset,
                group.slice.count,
                timing.gemm_done_us,
                timing.comm_start_us,
                timing.comm_end_us
            )?;
        }
        // The overlapped call pays the backend's per-call cost on top of its timeline.
        let overlap = Schedule::Overlap.predicted_us(t, self.overlap_fixed_us);
        let mut fixed = String::new();
        if self.overlap_fixed_us > 0.0 {
            fixed += &format!(" (with {:.0} us per call)", self.overlap_fixed_us);
        }
        let per_group = t.groups_overhead_us();
        if per_group > 0.0 {
            fixed += &format!(
                " (with {:.0} us per group)",
                per_group / t.groups.len() as f64
            );
        }
        writeln!(
            f,
            "predicted: {overlap:.1} us as planned{fixed} vs {:.1} us sequential, speedup {:.2}x",
            t.sequential_us,
            t.sequential_us / overlap
        )?;
        let end = t.overlap_us.max(t.gemm_us);
        let column =
            |us: f64| ((us / end * TIMELINE_COLUMNS as f64) as usize).min(TIMELINE_COLUMNS);
        let mut gemm = vec![' '; TIMELINE_COLUMNS];
        gemm[..column(t.gemm_us)].fill('#');
        let mut comm = vec![' '; TIMELINE_COLUMNS];
        for (g, timing) in t.groups.iter().enumerate() {
            let label = char::from_digit(g as u32 % 36, 36).unwrap_or('?');
            // Every collective shows, however short.
            let first = column(timing.comm_start_us).min(TIMELINE_COLUMNS - 1);
            let last = column(timing.comm_end_us).max(first + 1);
            comm[first..last].fill(label);
        }
        writeln!(
            f,
            "timeline: 0 .. {end:.1} us, {:.1} us per column",
            end / TIMELINE_COLUMNS as f64
        )?;
        writeln!(f, "  gemm |{}|", gemm.iter().collect::<String>())?;
        write!(f, "  comm |{}|", comm.iter().collect::<String>())
    }
}

#[cfg(test)]
mod tests {
    use crate::plan::gemm_all_reduce::{plan_gemm_all_reduce, ModeRequest, PlanRequest};
    use crate::plan::predictor::HardwareModel;
    use crate::plan::testing::request;

    fn describe(mode: ModeRequest) -> String {
        let req = PlanRequest {
            mode,
            ..request(16384, 8192, 4096, 8)
        };
        plan_gemm_all_reduce(&req, &HardwareModel::h200())
            .unwrap()
            .describe()
    }

    #[test]
    fn overlap_summary_lists_groups_and_draws_both_streams() {
        let text = describe(ModeRequest::Overlap);
        println!("{text}");
        assert!(text.contains("128 x 64 = 8192 tiles"));
        assert!(text.contains("ctas: 120, 12 SMs left to the collective -> 69 waves"));
        assert!(text.contains("schedule: overlap"));
        assert!(text.contains("speedup"));
        let gemm = text.lines().find(|l| l.starts_with("  gemm |")).unwrap();
        let comm = text.lines().find(|l| l.starts_with("  comm |")).unwrap();
        assert_eq!(gemm.chars().count(), "  gemm |".len() + 60 + 1);
        assert_eq!(comm.chars().count(), gemm.chars().count());
        assert!(comm.contains('0') && comm.contains('1'));
    }

    #[test]
    fn sequential_summary_has_one_group_after_the_gemm() {
        let text = describe(ModeRequest::Sequential);
        assert!(text.contains("schedule: sequential, 1 group(s)"));
        assert!(text.contains("speedup 1.00x"));
        let comm = text.lines().last().unwrap();
        assert!(comm.trim_end_matches('|').ends_with('0'));
    }
}
