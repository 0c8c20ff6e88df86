"""What the studies run on, built once and committed: the real model's RL-near teacher
(``real_teacher.py``; its delta ships in ``src/lookahead_opd/integrations/weights``)."""
