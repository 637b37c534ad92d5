//! Haechi's adaptive capacity estimation (Algorithm 1): the tokens a memory node hands out in the
//! next period, from the I/Os completed in the last ones.
//!
//! A period that used every token (`U == estimate`) may have had more capacity: the estimate
//! grows by `eta`. A period that used fewer, but at least the lower bound, is a measurement:
//! it enters a window of the last `window` such periods, whose mean becomes the estimate. A
//! period below the lower bound (low demand) says nothing about capacity and is ignored.

use std::collections::VecDeque;

#[derive(Clone, Debug)]
pub struct CapacityEstimator {
    estimate: u64,
    lower_bound: u64,
    eta: u64,
    window: usize,
    history: VecDeque<u64>,
}

impl CapacityEstimator {
    /// `profiled`: the profiled capacity per period; `sigma` its standard deviation (the lower
    /// bound is `profiled - 3 sigma`); `eta`: the growth step; `window`: periods averaged.
    pub fn new(profiled: u64, sigma: u64, eta: u64, window: usize) -> CapacityEstimator {
        CapacityEstimator {
            estimate: profiled,
            lower_bound: profiled.saturating_sub(3 * sigma),
            eta,
            window: window.max(1),
            history: VecDeque::new(),
        }
    }

    /// Tokens for the next period.
    pub fn estimate(&self) -> u64 {
        self.estimate
    }

    pub fn lower_bound(&self) -> u64 {
        self.lower_bound
    }

    /// Folds in the I/Os completed in the period that just ended; returns the new estimate.
    pub fn end_period(&mut self, completed: u64) -> u64 {
        if completed >= self.estimate {
            self.estimate += self.eta;
        } else if completed >= self.lower_bound {
            self.history.push_back(completed);
            if self.history.len() > self.window {
                self.history.pop_front();
            }
            self.estimate = self.history.iter().sum::<u64>() / self.history.len() as u64;
        }
        self.estimate
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_when_saturated_follows_drops_and_ignores_idle_periods() {
        let mut e = CapacityEstimator::new(1000, 50, 20, 3);
        assert_eq!(e.lower_bound(), 850);
        assert_eq!(e.end_period(1000), 1020, "every token used: grow");
        assert_eq!(e.end_period(900), 900, "a measurement");
        assert_eq!(
            e.end_period(100),
            900,
            "below the lower bound: idle, ignored"
        );
        assert_eq!(e.end_period(860), 880, "(900 + 860) / 2");
        assert_eq!(e.end_period(880), 900, "every token used again: grow");
        assert_eq!(e.end_period(870), 876, "(900 + 860 + 870) / 3");
        assert_eq!(e.end_period(875), 868, "window of 3: (860 + 870 + 875) / 3");
    }
}
