// The autoscaler on tables (no actors): each row is one interval (its
// arrivals and TTFTs, the active and alive entry stages) and the count the
// controller wants; the rules are those of actors/scale_controller.h.
#include <doctest/doctest.h>

#include <cmath>
#include <vector>

#include "actors/scale_controller.h"

using namespace cleave;

namespace {

struct Interval {
  int32_t arrivals;
  std::vector<double> ttft_ms;
  int32_t active, available;
  int32_t want;
};

void run(ScaleController& c, const std::vector<Interval>& rows) {
  double t = 0;
  int row = 0;
  for (const Interval& r : rows) {
    CAPTURE(row);
    for (int32_t i = 0; i < r.arrivals; ++i) c.observe_arrival();
    for (double v : r.ttft_ms) c.observe_ttft(v / 1e3);
    t += c.config().interval_s;
    CHECK(c.decide(t, r.active, r.available) == r.want);
    ++row;
  }
}

AutoscaleConfig reactive(double ttft_ms = 100, int32_t confirm = 2, double cooldown_s = 3) {
  AutoscaleConfig c;
  c.ttft_ms = ttft_ms;
  c.interval_s = 1;
  c.confirm = confirm;
  c.cooldown_s = cooldown_s;
  return c;
}

AutoscaleConfig holt(double stage_rps, double horizon_s, int32_t confirm = 2) {
  AutoscaleConfig c = reactive(100, confirm, 3);
  c.forecast = "holt";
  c.stage_rps = stage_rps;
  c.horizon_s = horizon_s;
  c.alpha = 0.5;
  c.beta = 0.5;
  return c;
}

void refused(const AutoscaleConfig& c, const char* needle) {
  Status st = validate_autoscale(c);
  CHECK(st.code() == Code::invalid_argument);
  CHECK_MESSAGE(st.message().find(needle) != std::string::npos, st.message());
}

}  // namespace

TEST_CASE("holt forecast: a constant stays constant, a line is followed with its slope, never below 0") {
  HoltForecast constant(0.5, 0.3);
  for (int i = 0; i < 20; ++i) constant.update(7);
  CHECK(constant.level() == doctest::Approx(7));
  CHECK(constant.trend() == doctest::Approx(0));
  CHECK(constant.forecast(10) == doctest::Approx(7));

  // x = 2 + 3 t: the level converges to the latest value and the trend to 3.
  HoltForecast line(0.5, 0.5);
  for (int t = 0; t < 60; ++t) line.update(2 + 3.0 * t);
  CHECK(line.level() == doctest::Approx(2 + 3.0 * 59).epsilon(1e-6));
  CHECK(line.trend() == doctest::Approx(3).epsilon(1e-6));
  CHECK(line.forecast(4) == doctest::Approx(2 + 3.0 * 63).epsilon(1e-6));

  // First sample: level = x, trend 0; the second moves them by alpha, beta.
  HoltForecast two(0.5, 0.5);
  two.update(10);
  CHECK(two.level() == 10);
  CHECK(two.trend() == 0);
  two.update(20);
  CHECK(two.level() == doctest::Approx(15));  // 0.5*20 + 0.5*(10 + 0)
  CHECK(two.trend() == doctest::Approx(2.5));  // 0.5*(15 - 10) + 0.5*0

  HoltForecast falling(1, 1);
  falling.update(10);
  falling.update(2);  // level 2, trend -8
  CHECK(falling.forecast(1) == 0);
}

TEST_CASE("autoscale, reactive: TTFT over the goal adds a stage once confirmed, low TTFT parks one after the cooldown") {
  ScaleController c(reactive(100, 2, 3));
  run(c, {
             {4, {50}, 1, 4, 1},           // on target
             {4, {300, 200}, 1, 4, 1},     // over: first of the streak
             {4, {250}, 1, 4, 2},          // confirmed: one more
             {4, {400}, 2, 4, 2},          // streak starts again
             {4, {400}, 2, 4, 3},
             {4, {120}, 3, 4, 3},          // over, streak 1
             {4, {80}, 3, 4, 3},           // between low and the goal: hold
             {1, {20}, 3, 4, 3},           // low, streak 1
             {0, {}, 3, 4, 2},             // quiet: streak 2, 4 s after the last step: park one
             {0, {}, 2, 4, 2},             // the streak restarts after a step down
             {0, {}, 2, 4, 2},             // streak 2, but within 3 s of the step down
             {0, {}, 2, 4, 1},             // 3 s: down
             {0, {}, 1, 4, 1},
             {0, {}, 1, 4, 1},             // min_stages 1: never below
         });
  CHECK(c.rate() == 0);
  CHECK(c.needed() == 0);
}

TEST_CASE("autoscale: never more than are alive, never fewer than min_stages, a dead stage's place is taken") {
  AutoscaleConfig cfg = reactive(100, 1, 0);
  cfg.min_stages = 2;
  ScaleController c(cfg);
  run(c, {
             {1, {500}, 2, 2, 2},  // over the goal but all are active
             {1, {500}, 1, 3, 2},  // one died: back to min_stages at once (over the goal: active + 1 is 2 too)
             {0, {}, 3, 3, 2},     // quiet, no cooldown: down to min_stages
             {0, {}, 2, 3, 2},
             {0, {}, 1, 1, 1},     // fewer alive than min_stages: all of them
         });
}

TEST_CASE("autoscale, holt: the stages the forecast rate needs come up before TTFT rises, down only when it allows") {
  // 4 requests/s per stage, 2 s ahead, TTFT always on target (a reactive
  // controller would add nothing). A ramp of 2 more requests/s each second:
  // level + 2 s of trend needs 2, 3, 4, 5 stages while the measured rate
  // alone (6, 8, 10, 12 /s) would need 2, 2, 3, 3.
  ScaleController c(holt(4, 2));
  run(c, {
             {2, {20}, 1, 6, 1},   // level 2, trend 0: 2/s needs 1
             {4, {20}, 1, 6, 1},   // level 3, trend 0.5: 4/s ahead, 1
             {6, {20}, 1, 6, 2},   // level 4.75, trend 1.125: 7/s ahead
             {8, {20}, 2, 6, 3},   // 10.25/s ahead
             {10, {20}, 3, 6, 4},  // 13.3/s
             {12, {20}, 4, 6, 5},  // 16.02/s
         });
  CHECK(c.rate() == doctest::Approx(12));
  CHECK(c.forecast_rate() == doctest::Approx(11.65234375 + 2 * 2.181640625));
  CHECK(c.needed() == 5);
}

TEST_CASE("autoscale, holt: a steady rate holds its stages, a fall parks them one at a time") {
  AutoscaleConfig cfg = holt(4, 2, 1);
  cfg.cooldown_s = 0;
  ScaleController c(cfg);
  run(c, {
             {8, {20}, 1, 4, 2},  // 8/s: 2 stages at once
             {8, {20}, 2, 4, 2},  // TTFT low, no cooldown, but the forecast needs 2
             {8, {20}, 2, 4, 2},
             {0, {}, 2, 4, 1},    // nothing arrives: level 4, trend -2, needs 1
             {0, {}, 1, 4, 1},
         });
}

TEST_CASE("autoscale: validation names the field") {
  CHECK(validate_autoscale(reactive()).ok());
  CHECK(validate_autoscale(holt(4, 2)).ok());
  AutoscaleConfig c = reactive();
  c.ttft_ms = 0;
  refused(c, "ttft_ms");
  c = reactive();
  c.min_stages = 0;
  refused(c, "min_stages");
  c = reactive();
  c.interval_s = 0;
  refused(c, "interval_s");
  c = reactive();
  c.confirm = 0;
  refused(c, "confirm");
  c = reactive();
  c.cooldown_s = -1;
  refused(c, "cooldown_s");
  c = reactive();
  c.low = 1;
  refused(c, "low");
  c = reactive();
  c.forecast = "arima";
  refused(c, "forecast");
  c = reactive();
  c.stage_rps = 3;
  refused(c, "stage_rps needs forecast");
  c = reactive();
  c.beta = 0.9;
  refused(c, "beta needs forecast");
  c = holt(0, 2);
  refused(c, "stage_rps");
  c = holt(4, -1);
  refused(c, "horizon_s");
  c = holt(4, 2);
  c.alpha = 0;
  refused(c, "alpha");
  c = holt(4, 2);
  c.beta = 1.5;
  refused(c, "beta");
  c = reactive();
  c.ttft_ms = std::nan("");
  refused(c, "ttft_ms");
}

TEST_CASE("autoscale, encoders: their controller is reactive on encode_ms with min_encoders as its floor") {
  AutoscaleConfig cfg = holt(4, 2);
  cfg.encode_ms = 50;
  cfg.min_encoders = 2;
  const AutoscaleConfig e = cfg.encoder_config();
  CHECK(e.ttft_ms == 50);
  CHECK(e.min_stages == 2);
  CHECK_FALSE(e.holt());  // without encoder_rps the forecast is the stages' alone
  CHECK_FALSE(e.encoders());
  CHECK(e.interval_s == cfg.interval_s);
  CHECK(e.confirm == cfg.confirm);
  CHECK(e.cooldown_s == cfg.cooldown_s);
  CHECK(e.low == cfg.low);
  ScaleController c(e);
  run(c, {
             {2, {80, 90}, 2, 4, 2},  // over 50 ms, streak 1 of 2
             {2, {80}, 2, 4, 3},      // confirmed: one more
             {0, {}, 3, 4, 3},        // quiet (text only): streak 1, within the cooldown
             {0, {}, 3, 4, 3},        // streak 2, 2 s after the step: still within 3 s
             {0, {}, 3, 4, 2},        // down
             {0, {}, 2, 4, 2},        // the floor
             {0, {}, 2, 4, 2},
         });
}

TEST_CASE("autoscale, shared budget: the side further over its goal keeps its capacity, floors hold") {
  struct Row {
    ScaleSide stages, encoders;
    int32_t budget;
    int32_t want_stages, want_encoders;
  };
  for (const Row& r : std::vector<Row>{
           {{3, 1, 0.5}, {2, 1, 2.0}, 0, 3, 2},    // no budget: unchanged
           {{3, 1, 0.5}, {2, 1, 2.0}, 5, 3, 2},    // within it
           {{3, 1, 0.5}, {2, 1, 2.0}, 4, 2, 2},    // image-heavy: a stage gives way
           {{3, 1, 0.5}, {2, 1, 2.0}, 3, 1, 2},    // ... down to its floor
           {{3, 1, 0.5}, {3, 1, 2.0}, 3, 1, 2},    // then the encoders give way too
           {{3, 1, 1.8}, {3, 1, 0.2}, 4, 3, 1},    // text-heavy: encoders give way
           {{2, 1, 0.0}, {3, 1, 1.5}, 3, 1, 2},    // no text at all: pressure 0
           {{2, 1, 1.0}, {2, 1, 1.0}, 3, 1, 2},    // a tie: the stages give way first
           {{2, 2, 0.1}, {2, 1, 3.0}, 3, 2, 1},    // the stages' floor holds
           {{1, 1, 0.0}, {1, 1, 0.0}, 2, 1, 1},
       }) {
    CAPTURE(r.budget);
    CAPTURE(r.stages.target);
    CAPTURE(r.encoders.target);
    ScaleSide st = r.stages, en = r.encoders;
    fit_budget(st, en, r.budget);
    CHECK(st.target == r.want_stages);
    CHECK(en.target == r.want_encoders);
  }
}

TEST_CASE("autoscale: units are unparked cheapest first and parked least loaded first") {
  auto parked = [](const std::vector<ScaleUnit>& u) {
    std::string out;
    for (const ScaleUnit& x : u) out += x.parked ? 'p' : 'a';
    return out;
  };
  std::vector<ScaleUnit> u = {{false, 3, 1.0}, {true, 0, 2.0}, {true, 0, 1.5}, {true, 0, 1.5}};
  ScaleSteps s = apply_scale_target(u, 3);
  CHECK(s.ups == 2);
  CHECK(s.downs == 0);
  CHECK(parked(u) == "apaa");  // 1.5 and 1.5 before 2.0; the first among equals
  u[2].in_flight = 5;
  u[3].in_flight = 1;
  s = apply_scale_target(u, 1);
  CHECK(s.downs == 2);
  CHECK(parked(u) == "ppap");  // the least loaded first: 3 (1 in flight), then 0 (3); 2 (5) stays
  u = {{false, 4, 1}, {false, 2, 1}, {false, 7, 1}};
  CHECK(apply_scale_target(u, 2).downs == 1);
  CHECK(parked(u) == "apa");
  CHECK(apply_scale_target(u, 9).ups == 1);  // never more than there are
  CHECK(parked(u) == "aaa");
  CHECK(apply_scale_target(u, 0).downs == 3);
}

TEST_CASE("autoscale, encoders: validation names the field") {
  AutoscaleConfig c = reactive();
  c.encode_ms = 200;
  c.min_encoders = 2;
  c.max_active = 3;
  CHECK(validate_autoscale(c).ok());
  c.max_active = 0;
  CHECK(validate_autoscale(c).ok());
  c.max_active = 2;  // below min_stages 1 + min_encoders 2
  refused(c, "max_active must be 0 (no budget) or from min_stages + min_encoders (3)");
  c.max_active = 9000;
  refused(c, "max_active");
  c = reactive();
  c.encode_ms = -1;
  refused(c, "encode_ms");
  c.encode_ms = std::nan("");
  refused(c, "encode_ms");
  c = reactive();
  c.encode_ms = 2e9;
  refused(c, "encode_ms");
  c = reactive();
  c.min_encoders = 2;
  refused(c, "min_encoders needs encode_ms");
  c = reactive();
  c.max_active = 4;
  refused(c, "max_active needs encode_ms");
  c = reactive();
  c.encode_ms = 100;
  c.min_encoders = 0;
  refused(c, "min_encoders must be 1 to 4096");
}

// encoder_rps gives the encoders' controller Holt's forecast over the image
// arrivals: the same ramp as the stages' table above brings encoders up
// while every encode is on target.
TEST_CASE("autoscale, encoders: with encoder_rps their controller forecasts the image arrivals") {
  AutoscaleConfig cfg = holt(4, 2);
  cfg.encode_ms = 50;
  cfg.encoder_rps = 4;
  REQUIRE(validate_autoscale(cfg).ok());
  const AutoscaleConfig e = cfg.encoder_config();
  CHECK(e.holt());
  CHECK(e.stage_rps == 4);
  CHECK(e.horizon_s == cfg.horizon_s);
  CHECK(e.alpha == cfg.alpha);
  CHECK(e.beta == cfg.beta);
  CHECK(validate_autoscale(e).ok());
  ScaleController c(e);
  run(c, {
             {2, {20}, 1, 6, 1},
             {4, {20}, 1, 6, 1},
             {6, {20}, 1, 6, 2},   // 7 image requests/s ahead at 4 each
             {8, {20}, 2, 6, 3},
             {10, {20}, 3, 6, 4},
             {12, {20}, 4, 6, 5},
         });
  CHECK(c.needed() == 5);
  // A different rate per encoder needs a different count: 8/s each.
  cfg.encoder_rps = 8;
  ScaleController half(cfg.encoder_config());
  run(half, {
                {2, {20}, 1, 6, 1},
                {4, {20}, 1, 6, 1},
                {6, {20}, 1, 6, 1},
                {8, {20}, 1, 6, 2},   // 10.25/s ahead
                {10, {20}, 2, 6, 2},  // 13.3/s
                {12, {20}, 2, 6, 3},  // 16.02/s
            });
}

TEST_CASE("autoscale, encoders: encoder_rps is refused without holt or encode_ms, or out of range") {
  AutoscaleConfig c = holt(4, 2);
  c.encoder_rps = 5;
  refused(c, "encoder_rps needs encode_ms and forecast = \"holt\"");
  c = reactive();
  c.encode_ms = 100;
  c.encoder_rps = 5;
  refused(c, "encoder_rps needs encode_ms and forecast = \"holt\"");
  c = holt(4, 2);
  c.encode_ms = 100;
  for (double bad : {-1.0, 2e6, std::nan("")}) {
    c.encoder_rps = bad;
    refused(c, "encoder_rps (image requests/s one encoder serves) must be above 0");
  }
  c.encoder_rps = 5;
  CHECK(validate_autoscale(c).ok());
}
